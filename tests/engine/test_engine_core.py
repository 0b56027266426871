"""EngineCore on token ids alone, and the LLMEngine front end's hand-offs to it.

The core is checked against the dense reference with no tokenizer anywhere (its module
loads no tokenizer library); the front end is checked for what crosses the border: a
stop string found in the text finishes its sequence in the core in the same step (its
blocks free at once), detokenization per step stays bounded in a long output, and
prompt-side fields (cache_salt, {"prompt": text}) reach the sequences and
num_cached_tokens comes back in the RequestOutput.
"""

import subprocess
import sys

import pytest

from paged_jax.baselines import reference
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.engine_core import EngineCore
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.loading import LoadedModel
from tests.helpers.greedy_check import assert_greedy_match

SETTINGS = dict(block_size=8, num_blocks=96, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                seq_buckets=(1, 4), token_buckets=(16, 64))  # few shapes to compile


class _Letters:
    """A stand-in tokenizer: token t is one letter, text encodes letter by letter; it
    counts the tokens its decode is asked for (no `tokenizers` backend: the window path)."""

    def __init__(self):
        self.decoded = 0

    def decode(self, token_ids, skip_special_tokens=True, **kwargs):
        self.decoded += len(token_ids)
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def encode(self, text):
        return [3 + ord(ch) % 200 for ch in text]


@pytest.fixture(scope="module")
def core(tiny_llama):
    return EngineCore(tiny_llama.config, tiny_llama.params, EngineConfig(**SETTINGS))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    tokenizer = _Letters()
    loaded = LoadedModel(tiny_llama.config, tiny_llama.params, tokenizer, "memory", "memory", 0.0)
    return LLMEngine(loaded, EngineConfig(**SETTINGS)), tokenizer


def _all_free(bm) -> bool:
    return bm.num_free_blocks == bm.num_usable_blocks


def test_the_core_module_loads_no_tokenizer_library():
    code = ("import sys, paged_jax.engine.engine_core\n"
            "bad = [m for m in ('transformers', 'tokenizers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_core_turns_token_ids_into_the_references_tokens(core, tiny_llama):
    prompts = {"a": [5, 6, 7], "b": list(range(9, 29))}
    max_tokens = {"a": 10, "b": 5}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens[rid], ignore_eos=True))
    got = {rid: [] for rid in prompts}
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            for delta in out.completions:
                assert len(delta.new_token_ids) == 1  # only what is new
                assert delta.new_logprobs is None  # none asked for
                got[out.request_id] += delta.new_token_ids
            if out.finished:
                finished[out.request_id] = out.completions[0].finish_reason
    assert finished == {"a": "length", "b": "length"}
    for rid, prompt in prompts.items():
        [want] = reference.generate(tiny_llama.params, tiny_llama.config, [prompt],
                                    max_new_tokens=max_tokens[rid], ignore_eos=True)
        assert_greedy_match(prompt, want, got[rid],
                            lambda p: reference.prompt_logits(tiny_llama.params, tiny_llama.config, [p])[0][-1])
    assert _all_free(core.block_manager)


def test_core_stops_at_a_stop_token(core):
    core.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for d in out.completions for t in d.new_token_ids]
    stop = tokens[3]
    core.add_request("stopped", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))
    last = None
    while core.has_unfinished_requests():
        for out in core.step():
            last = out.completions[-1]
    assert (last.finish_reason, last.stop_reason, last.new_token_ids) == ("stop", stop, [stop])
    assert _all_free(core.block_manager)


def test_finish_sequence_frees_a_stopped_completions_blocks_now(core):
    core.add_request("pair", list(range(5, 21)), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40,
                                                                 ignore_eos=True))
    lengths = {0: 0, 1: 0}
    while min(lengths.values()) < 10:
        for out in core.step():
            for d in out.completions:
                lengths[d.index] += len(d.new_token_ids)
    free = core.block_manager.num_free_blocks
    core.finish_sequence("pair", 0, "a stop string")
    assert core.block_manager.num_free_blocks > free  # completion 0's own blocks, at once
    moved = [d.index for out in core.step() for d in out.completions]
    assert moved == [1]
    core.finish_sequence("pair", 1, "another")
    core.finish_sequence("pair", 1, "again")  # finished or unknown: a no-op
    core.finish_sequence("nobody", 0, "x")
    assert not core.has_unfinished_requests() and _all_free(core.block_manager)


def test_a_stop_string_finishes_its_sequence_in_the_step_that_finds_it(engine):
    engine, _ = engine
    prompt = {"prompt_token_ids": [5, 6, 7]}
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
    text = outs[0].outputs[0].text
    stop = text[4:7]
    k = next(i for i in range(len(text)) if stop in text[:i + 1])  # one letter per token
    engine.add_request("cut", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    while True:
        [out] = engine.step()
        if out.finished:
            break
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:text.index(stop)], "stop", stop)
    assert len(c.token_ids) == k + 1
    assert not engine.has_unfinished_requests() and _all_free(engine.block_manager)  # freed in that step


def test_detokenization_per_step_stays_bounded_in_a_long_output(engine):
    engine, tokenizer = engine
    engine.add_request("long", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=["never-there"]))
    per_step = []
    while engine.has_unfinished_requests():
        before = tokenizer.decoded
        engine.step()
        per_step.append(tokenizer.decoded - before)
    assert len(per_step) >= 200
    assert max(per_step[-50:]) <= 8, per_step[-50:]  # decoding the whole output would ask for ~200


def test_cache_salt_reaches_the_sequences_and_num_cached_tokens_comes_back(engine):
    engine, _ = engine
    params = SamplingParams(temperature=0, max_tokens=3)
    engine.add_request("ids", {"prompt_token_ids": list(range(5, 30)), "cache_salt": "tenant-1"}, params)
    engine.add_request("text", {"prompt": "hello there", "cache_salt": "tenant-2"}, params)
    seqs = {s.request_id: s for s in engine.scheduler.waiting}
    assert (seqs["ids"].cache_salt, seqs["text"].cache_salt) == ("tenant-1", "tenant-2")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outs["text"].prompt == "hello there" and outs["text"].prompt_token_ids == _Letters().encode("hello there")
    for rid, seq in seqs.items():
        assert outs[rid].num_cached_tokens == seq.num_cached_tokens


def test_a_prompt_checked_against_other_limits_is_checked_again(core):
    """The core takes a ProcessedPrompt's ids as checked only if its Processor checked them
    against this engine's max_model_len and vocabulary."""
    from paged_jax.engine.processor import Processor

    limit, vocab = core.config.max_model_len, core.model_config.vocab_size
    too_long = [1] * limit
    lax = Processor(None, limit + 10, vocab).process(too_long)  # passes a laxer Processor's check
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request("lax", lax, SamplingParams(max_tokens=1))
    outside = Processor(None, limit, vocab + 5).process([vocab + 1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request("outside", outside, SamplingParams(max_tokens=1))
    assert not core.has_unfinished_requests()
    ok = Processor(None, limit, vocab).process([1, 2, 3])
    assert ok.checked == (limit, vocab)
    core.add_request("ok", ok, SamplingParams(max_tokens=1))
    assert core.has_request("ok")
    core.abort_request("ok")
