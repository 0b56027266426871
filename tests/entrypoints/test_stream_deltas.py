"""A stream's chunks, concatenated, are the whole answer, also when its reader lags.

The server streams DELTA outputs: each step's output carries only what is new, a
RequestStream merges the outputs its handler has not taken yet (a reader that fell
behind), and the ResponseBuilder sends each as it comes. Here the same engine-core
outputs (SmolLM2's tokenizer, multi-byte characters split across tokens, n = 2, top
logprobs) reach a FINAL_ONLY processor, whose output makes the whole response, and a
DELTA processor behind a RequestStream that is read after bursts of 1 to 5 steps; the
chunks' text, token ids, logprobs (with offsets) and usage must equal the whole response's.
"""

import asyncio
import json
import random

import pytest

from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.entrypoints.openai.request_stream import ACCEPTED, RequestStream
from paged_jax.entrypoints.openai.responses import ResponseBuilder
from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer

TEXTS = ("Naïve café — 日本語 🎉 done. The capital of France is Paris, a city of light.",
         "🎉🎉 über straße, ça va? 中文字符 and more text to stream along.")


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


def _core_outputs(tok, rng) -> list[EngineCoreOutput]:
    """Two completions of one request, 1-3 tokens per step each, byte-level pieces included."""
    ids = [tok.encode(t) for t in TEXTS]
    at, steps, step = [0, 0], [], 0
    while any(a < len(i) for a, i in zip(at, ids)):
        deltas = []
        for index in range(2):
            if at[index] >= len(ids[index]):
                continue
            new = ids[index][at[index]:at[index] + rng.randint(1, 3)]
            at[index] += len(new)
            done = at[index] >= len(ids[index])
            lps = [-0.1 * (step + 1) - index] * len(new)
            tops = [[(t, lp), (t + 1, lp - 1.0)] for t, lp in zip(new, lps)]
            deltas.append(CompletionDelta(index, new, lps, tops, sum(lps), "length" if done else None))
        finished = all(a >= len(i) for a, i in zip(at, ids))
        steps.append(EngineCoreOutput("e0", deltas, finished, float(step), 0.0, 0.0, 0))
        step += 1
    return steps


def _builder(tok, chat):
    return ResponseBuilder(chat=chat, request_id="r", model="m", engine_ids=["e0"], n=2, tokenizer=tok,
                           logprobs=2, return_token_ids=True)


async def _streamed(tok, core, chat, rng):
    processor = OutputProcessor(tok)
    params = SamplingParams(n=2, max_tokens=1000, logprobs=2, output_kind=RequestOutputKind.DELTA)
    processor.add_request("e0", None, [1, 2], params)
    stream = RequestStream(None, ["e0"], processor, delta_ids=["e0"])  # no stop strings: no command to its owner
    stream.put(ACCEPTED)
    await stream.accepted()
    builder, bodies, final, pending, taken = _builder(tok, chat), [], None, list(core), 0
    while not stream.finished:
        for _ in range(rng.randint(1, 5)):  # the engine's outputs of several steps, while the handler was busy
            if pending:
                stream.put(pending.pop(0))
        assert stream.num_pending <= 1
        out = await stream.next()
        taken += 1
        bodies += [json.loads(c.removeprefix("data: ")) for c in builder.chunks(out)]
        if out.finished:
            final = out
    usage = json.loads(builder.usage_chunk([final]).removeprefix("data: "))["usage"]
    return bodies, usage, taken


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_chunks_concatenated_are_the_whole_response(tok, chat, seed):
    rng = random.Random(seed)
    core = _core_outputs(tok, rng)
    whole_processor = OutputProcessor(tok)
    whole_processor.add_request("e0", None, [1, 2], SamplingParams(n=2, max_tokens=1000, logprobs=2,
                                                                   output_kind=RequestOutputKind.FINAL_ONLY))
    [final] = [o for c in core for o in whole_processor.process([c]).request_outputs]
    assert [c.text for c in final.outputs] == [tok.decode(tok.encode(t)) for t in TEXTS]  # the cases are real
    whole = _builder(tok, chat).response([final]).model_dump()
    bodies, usage, taken = asyncio.run(_streamed(tok, core, chat, rng))
    assert taken < len(core)  # some outputs were merged while pending
    for choice in whole["choices"]:
        parts = [c for b in bodies for c in b["choices"] if c["index"] == choice["index"]]
        if chat:
            assert "".join(c["delta"]["content"] or "" for c in parts) == choice["message"]["content"]
            streamed_lps = [e for c in parts if c["logprobs"] for e in c["logprobs"]["content"]]
            assert streamed_lps == choice["logprobs"]["content"]
        else:
            assert "".join(c["text"] for c in parts) == choice["text"]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [x for c in parts if c["logprobs"] for x in c["logprobs"][key]] == choice["logprobs"][key]
        assert [t for c in parts for t in c["token_ids"] or []] == choice["token_ids"]
        assert [c["finish_reason"] for c in parts if c["finish_reason"]] == [choice["finish_reason"]]
        assert not any("\ufffd" in (c["delta"]["content"] or "" if chat else c["text"]) for c in parts)
    assert usage == whole["usage"]
