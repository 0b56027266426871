"""SamplingParams.output_kind: CUMULATIVE, DELTA and FINAL_ONLY outputs of the same steps.

The same core outputs (token ids fed as the engine core reports them, several per step
for some steps) go through one OutputProcessor per kind. DELTA's pieces, concatenated up
to any step, must be the CUMULATIVE output of that step (text, token ids, logprobs, top
logprobs), and FINAL_ONLY's one output the last CUMULATIVE one; the CUMULATIVE final text
itself is checked against the tokenizer's own decode. The cases are the hard ones for a
delta: a stop string spanning two steps, one found in the middle of a step's tokens (the
tokens after it in that step are dropped), multi-byte characters split across tokens,
n = 2 with a completion that stops early (the core still reports its tokens once more).

The per-step cost is checked without a clock: tracemalloc's peak of what a step
allocates stays the same at output token ~2000 as at token ~50 (a re-join of the text or
a copy of the token lists would grow with the output).
"""

import statistics
import tracemalloc

import pytest

from paged_jax.core.outputs import RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
TEXT = "The capital of France is Paris. It is a city of light. Naïve café — 日本語 🎉 done, and more."


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


@pytest.mark.parametrize("kind", ["cumulative", "DELTA", "Final_Only", *RequestOutputKind])
def test_output_kind_accepts_the_three_kinds_by_member_or_name(kind):
    params = SamplingParams(output_kind=kind)
    assert isinstance(params.output_kind, RequestOutputKind)
    assert params.output_kind.name == (kind.name if isinstance(kind, RequestOutputKind) else kind.upper())
    assert SamplingParams().output_kind is CUMULATIVE  # vLLM's default


@pytest.mark.parametrize("kind", [None, 1, True, "stream", "final", 1.0])
def test_output_kind_refuses_anything_else_and_names_the_kinds(kind):
    with pytest.raises(ValueError, match=r"output_kind must be one of RequestOutputKind.CUMULATIVE .*'delta'.*"
                                         r"FINAL_ONLY.*got"):
        SamplingParams(output_kind=kind)


def _run(tok, kind, steps, *, n, stops, logprobs):
    """Feed `steps` (per step, per completion index, its new token ids; the last step
    finishes every completion still running by length) through a processor; returns the
    outputs of each step (None where the step had none) and what was to be finished."""
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1], SamplingParams(n=n, max_tokens=10_000, stop=stops, logprobs=logprobs,
                                                         output_kind=kind))
    outputs, stopped, num = [], [], [0] * n
    reported_until = {}  # completion ended by a stop string -> the last step the core still reports it
    for step, moves in enumerate(steps):
        last = step == len(steps) - 1
        deltas = []
        for index, ids in moves.items():
            if step > reported_until.get(index, step):
                continue
            lps = [-0.01 * (num[index] + j + 1) - index for j in range(len(ids))]  # distinct per token
            tops = [[(t, lp), (t + 1, lp - 1.0)] for t, lp in zip(ids, lps)]
            num[index] += len(ids)
            deltas.append(CompletionDelta(index, ids, lps, tops, sum(lps), "length" if last else None))
        result = processor.process([EngineCoreOutput("r", deltas, last, float(step), 0.0, 0.0, 0)])
        assert len(result.request_outputs) <= 1
        outputs.append(result.request_outputs[0] if result.request_outputs else None)
        for _, index, _ in result.stopped:  # its next step ran before the core heard: reported once more
            reported_until[index] = step + 1
        stopped.append(result.stopped)
    return outputs, stopped


def _concat(outputs: list[RequestOutput | None]):
    """Per step, per completion index: the DELTA outputs so far, concatenated."""
    text, ids, lps, tops, per_step = {}, {}, {}, {}, []
    for out in outputs:
        if out is not None:
            for c in out.outputs:
                text[c.index] = text.get(c.index, "") + c.text
                ids[c.index] = ids.get(c.index, []) + c.token_ids
                lps[c.index] = lps.get(c.index, []) + (c.logprobs or [])
                tops[c.index] = tops.get(c.index, []) + (c.top_logprobs or [])
        per_step.append({i: (text[i], ids[i], lps[i], tops[i]) for i in text})
    return per_step


def _cumulative_view(out: RequestOutput):
    return {c.index: (c.text, c.token_ids, c.logprobs or [], c.top_logprobs or []) for c in out.outputs}


def _split(ids, sizes):
    """ids cut into consecutive steps of the given sizes (the last size repeats)."""
    steps, at, k = [], 0, 0
    while at < len(ids):
        size = sizes[min(k, len(sizes) - 1)]
        steps.append(ids[at:at + size])
        at, k = at + size, k + 1
    return steps


def _cases(tok):
    ids = tok.encode(TEXT)
    other = tok.encode("日本語 🎉 is split into bytes; Paris is far. The end of the other completion text")
    return {
        # one token per step: "ital of Fr" starts in " capital" and completes in " France" (spans steps)
        "spans_steps": ([{0: [t]} for t in ids], ("ital of Fr",)),
        # three tokens per step: " Paris." completes in the middle of a step, tokens after it in that step
        "mid_delta": ([{0: s} for s in _split(ids, [3])], ("Paris.",)),
        # multi-byte characters whose bytes come as separate tokens, 1 and 2 tokens per step
        "multibyte": ([{0: s} for s in _split(ids, [1, 2])], ("🎉 do!", "本語 🎉 d")),
        # n = 2: completion 0 stops at "Paris" (and is reported once more), completion 1 runs to the end
        "n2": ([{0: a, 1: b} for a, b in zip(_split(ids, [2]), _split(other, [2]))], ("Paris",)),
    }


@pytest.mark.parametrize("case", ["spans_steps", "mid_delta", "multibyte", "n2"])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_delta_outputs_concatenated_are_the_cumulative_outputs(tok, case, logprobs):
    steps, stops = _cases(tok)[case]
    n = max(max(m) for m in steps) + 1
    cumulative, cum_stopped = _run(tok, CUMULATIVE, steps, n=n, stops=stops, logprobs=logprobs)
    delta, delta_stopped = _run(tok, DELTA, steps, n=n, stops=stops, logprobs=logprobs)
    final_only, _ = _run(tok, FINAL_ONLY, steps, n=n, stops=stops, logprobs=logprobs)
    assert cum_stopped == delta_stopped and any(cum_stopped)  # the stop string was found, at the same step
    concatenated = _concat(delta)
    for step, (cum, so_far) in enumerate(zip(cumulative, concatenated)):
        if cum is None:  # the request finished at an earlier step
            assert delta[step] is None
            continue
        assert so_far == _cumulative_view(cum), step
        if delta[step] is not None:
            assert (delta[step].finished, [c.finish_reason for c in delta[step].outputs]) == (
                cum.finished, [c.finish_reason for c in cum.outputs])
    last = next(o for o in reversed(cumulative) if o is not None)
    assert last.finished
    # FINAL_ONLY: nothing until the end, then the whole of it
    assert [o is None for o in final_only] == [o is None or not o.finished for o in cumulative]
    final = next(o for o in final_only if o is not None)
    assert _cumulative_view(final) == _cumulative_view(last)
    # and the cumulative text is the tokenizer's decode of the tokens, cut before the stop string
    for c in last.outputs:
        whole = tok.decode(sum((m.get(c.index, []) for m in steps), []), skip_special_tokens=True)
        if c.finish_reason == "stop":
            assert c.text == whole[:whole.index(c.stop_reason)] and c.stop_reason in stops
        else:
            assert c.text == whole
    # a delta carries only what is new: no step's output repeats a token sent before
    sent = sum(len(c.token_ids) for o in delta if o is not None for c in o.outputs)
    assert sent == sum(len(c.token_ids) for c in last.outputs)


def test_prompt_logprobs_come_once_in_a_delta_stream(tok):
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=3, prompt_logprobs=1, output_kind=DELTA))
    firsts = []
    for step in range(3):
        delta = CompletionDelta(0, [100 + step], None, None, None, "length" if step == 2 else None)
        prompt = [(2, -1.0, 1, [(2, -1.0)]), (3, -2.0, 2, [(9, -1.5)])] if step == 0 else None
        [out] = processor.process([EngineCoreOutput("r", [delta], step == 2, 0.0, 0.0, 0.0, 0, prompt)]).request_outputs
        firsts.append(out.prompt_logprobs)
    assert firsts[0] is not None and len(firsts[0]) == 3 and firsts[1:] == [None, None]


def _long_ids(tok, n):
    ids = []
    while len(ids) < n:
        ids += tok.encode(TEXT + " ")
    return ids[:n]


@pytest.mark.parametrize("kind", [DELTA, FINAL_ONLY])
def test_a_step_allocates_the_same_at_token_2000_as_at_token_50(tok, kind):
    """What a step allocates (tracemalloc's peak over the step, above what was held before
    it) for one completion with stop strings and top logprobs: the median over steps
    2000-2063 is within a few hundred bytes of the median over steps 50-113. A re-join of
    the ~9,000 characters of text, or a copy of the 2,000 token ids (16 kB), would add
    thousands of bytes a step. (List growth reallocates now and then: hence medians.)"""
    ids = _long_ids(tok, 2064)
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1], SamplingParams(max_tokens=10_000, stop=("never-there", "nor this one"),
                                                         logprobs=2, output_kind=kind))
    per_step = []
    tracemalloc.start()
    try:
        for step, token in enumerate(ids):
            delta = CompletionDelta(0, [token], [-0.5], [[(token, -0.5), (token + 1, -1.5)]], -0.5 * (step + 1), None)
            core = [EngineCoreOutput("r", [delta], False, float(step), 0.0, 0.0, 0)]
            tracemalloc.reset_peak()
            held = tracemalloc.get_traced_memory()[0]
            result = processor.process(core)
            per_step.append(tracemalloc.get_traced_memory()[1] - held)
            del result
    finally:
        tracemalloc.stop()
    early, late = statistics.median(per_step[50:114]), statistics.median(per_step[2000:2064])
    assert late <= early + 256, (early, late)
