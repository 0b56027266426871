"""The paged engine against the dense reference: greedy outputs token for token.

A random trace (prompts 1..300 tokens, outputs 1..200) runs through engines with block
sizes 1, 8, 16 and 32, with and without chunked prefill, and under KV budgets small
enough that preemption (by recompute and by swap) happens many times.
"""

import random

import pytest

from paged_jax.baselines import reference
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from tests.helpers.greedy_check import assert_greedy_match

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def trace():
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 300))] for _ in range(40)]
    prompts[0] = [7]  # the extremes: a one-token prompt and a 300-token one with 200 new tokens
    prompts[1] = [rng.randrange(3, 256) for _ in range(300)]
    max_tokens = [rng.randint(1, 200) for _ in prompts]
    max_tokens[1] = 200
    return prompts, max_tokens


@pytest.fixture(scope="module")
def expected(model, trace):
    """Reference greedy outputs; rows are independent, so one batched run serves all."""
    prompts, max_tokens = trace
    outs = reference.generate(model.params, model.config, prompts, max_new_tokens=max(max_tokens), ignore_eos=True)
    return [out[:n] for out, n in zip(outs, max_tokens)]


def _run(model, trace, **settings):
    prompts, max_tokens = trace
    llm = LLM(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, **settings)
    compilations = llm.stats()["num_compilations"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens],
                           use_tqdm=False)
    llm.engine.block_manager.check_invariants()
    stats = llm.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"], "every block returns to the free pool"
    assert stats["num_compilations"] == compilations, "nothing compiles after warm-up"
    return outputs, stats


def _assert_matches(model, trace, expected, outputs):
    prompts, _ = trace
    logits = lambda ids: reference.prompt_logits(model.params, model.config, [ids])[0][-1]
    for prompt, want, out in zip(prompts, expected, outputs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert_greedy_match(prompt, want, out.outputs[0].token_ids, logits)


# (block_size, blocks in the pool, chunked prefill, preemption mode, token budget, attention)
CASES = [
    pytest.param(16, 400, True, "recompute", 64, "reference", id="bs16-roomy-chunked"),
    pytest.param(1, 1100, True, "recompute", 64, "reference", id="bs1-tight-chunked-recompute"),
    pytest.param(8, 110, False, "swap", 512, "reference", id="bs8-tight-whole-prefill-swap"),
    pytest.param(16, 60, True, "swap", 96, "reference", id="bs16-tight-chunked-swap"),
    pytest.param(32, 30, False, "recompute", 512, "reference", id="bs32-tight-whole-prefill-recompute"),
    # the Pallas kernel in interpret mode (~30 s here): its own tests check it in the default run
    pytest.param(16, 60, True, "swap", 96, "pallas", id="bs16-tight-chunked-swap-pallas", marks=pytest.mark.slow),
    pytest.param(16, 60, True, "swap", 96, "native", id="bs16-tight-chunked-swap-native"),
    pytest.param(8, 110, False, "recompute", 512, "native", id="bs8-tight-whole-prefill-recompute-native"),
]


@pytest.mark.parametrize("block_size, num_blocks, chunked, mode, budget, attention", CASES)
def test_greedy_equals_reference(model, trace, expected, block_size, num_blocks, chunked, mode, budget, attention):
    outputs, stats = _run(model, trace, block_size=block_size, num_blocks=num_blocks,
                          enable_chunked_prefill=chunked, preemption_mode=mode, max_num_batched_tokens=budget,
                          swap_space_bytes=64 * 2**20, attention_backend=attention,
                          # few buckets: warm-up compiles every (rows, tokens) pair, ~40 by default at 512
                          seq_buckets=(2, 8), token_buckets=(16, 64, budget))
    _assert_matches(model, trace, expected, outputs)
    tight = num_blocks * block_size < 8 * MAX_MODEL_LEN  # fewer slots than 8 full sequences
    if tight:
        assert stats["num_preemptions"] >= 5, stats
    assert stats["max_batched_seqs"] > 1


# async scheduling (EngineConfig.async_scheduling): each step is scheduled while the one before
# runs, its pending tokens fed on the device; the CPU's default is off, so these turn it on
ASYNC_CASES = [
    pytest.param(1, 1100, True, "recompute", 64, "reference", id="bs1-tight-chunked-recompute-async"),
    pytest.param(16, 60, True, "swap", 96, "native", id="bs16-tight-chunked-swap-native-async"),
    pytest.param(8, 110, False, "recompute", 512, "native", id="bs8-tight-whole-prefill-recompute-native-async"),
]


@pytest.mark.parametrize("block_size, num_blocks, chunked, mode, budget, attention", ASYNC_CASES)
def test_greedy_equals_reference_with_async_scheduling(model, trace, expected, block_size, num_blocks, chunked,
                                                       mode, budget, attention):
    outputs, stats = _run(model, trace, block_size=block_size, num_blocks=num_blocks,
                          enable_chunked_prefill=chunked, preemption_mode=mode, max_num_batched_tokens=budget,
                          swap_space_bytes=64 * 2**20, attention_backend=attention, async_scheduling=True,
                          seq_buckets=(2, 8), token_buckets=(16, 64, budget))
    _assert_matches(model, trace, expected, outputs)
    assert stats["num_preemptions"] >= 5, stats
