"""Block sharing in the engine: prefix caching and parallel sampling (n > 1) by fork.

Every output is checked against the dense reference (greedy with the near-tie rule;
seeded sampling exactly, since each completion's stream depends only on (seed, index)),
and every run must end with all blocks free (or free and cached).
"""

import random

import jax
import pytest

import configs
from paged_jax.baselines import reference
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.engine.llm_engine import completion_seed
from paged_jax.loading import LoadedModel
from paged_jax.model.llama import init_params
from tests.helpers.greedy_check import assert_greedy_match

BLOCK_SIZE = 8
PREFIX_LEN = 70  # 8 full blocks of 8 and 6 tokens into the 9th


@pytest.fixture(scope="module")
def model():
    cfg = configs.get_config("tiny_llama")
    return LoadedModel(cfg, init_params(cfg, jax.random.key(3)), None, "memory", "memory", 0.0)


@pytest.fixture(scope="module")
def shared_prefix_trace():
    rng = random.Random(7)
    prefix = [rng.randrange(3, 256) for _ in range(PREFIX_LEN)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    for p in prompts[1:]:  # each suffix differs from the first at once
        p[PREFIX_LEN] = (prompts[0][PREFIX_LEN] + 1 + rng.randrange(250)) % 253 + 3
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def expected(model, shared_prefix_trace):
    prompts, max_tokens = shared_prefix_trace
    outs = reference.generate(model.params, model.config, prompts, max_new_tokens=max(max_tokens), ignore_eos=True)
    return [out[:n] for out, n in zip(outs, max_tokens)]


def _llm(model, **settings):
    settings = {"block_size": BLOCK_SIZE, "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                "attention_backend": "reference", "paper_metrics": True, **settings}  # sharing_savings
    # few buckets (warm-up compiles every pair), each covering its maximum
    settings.setdefault("seq_buckets", (2, settings["max_num_seqs"]))
    settings.setdefault("token_buckets", (16, settings["max_num_batched_tokens"]))
    return LLM(model, **settings)


def _generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.block_manager.check_invariants()
    stats = llm.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"], "every block is free (or free and cached)"
    return [o.outputs[0].token_ids for o in outs], stats


def _assert_all_match(model, prompts, expected, actual):
    logits = lambda ids: reference.prompt_logits(model.params, model.config, [ids])[0][-1]
    for prompt, want, got in zip(prompts, expected, actual):
        assert_greedy_match(prompt, want, got, logits)


@pytest.mark.parametrize("caching", [False, True])
def test_prefix_caching_keeps_greedy_outputs(model, shared_prefix_trace, expected, caching):
    prompts, max_tokens = shared_prefix_trace
    llm = _llm(model, enable_prefix_caching=caching)
    # One request first, so the prefix is cached before the rest arrive together.
    first, _ = _generate(llm, prompts[:1], max_tokens[:1])
    rest, stats = _generate(llm, prompts[1:], max_tokens[1:])
    _assert_all_match(model, prompts, expected, first + rest)
    if not caching:
        assert stats["prefix_cache_hit_tokens"] == 0 and stats["num_blocks_cached"] == 0
        return
    # Arithmetic: the first request finds nothing; each later one hits the prefix's
    # full blocks, floor(70 / 8) = 8 blocks = 64 tokens (its 9th block differs).
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hit_tokens"] == (len(prompts) - 1) * (PREFIX_LEN // BLOCK_SIZE) * BLOCK_SIZE


def test_identical_prompts_hit_all_but_the_last_token(model, shared_prefix_trace, expected):
    prompts, max_tokens = shared_prefix_trace
    llm = _llm(model)
    _generate(llm, prompts[:1], max_tokens[:1])
    before = llm.stats()["prefix_cache_hit_tokens"]
    again, _ = _generate(llm, prompts[:1], max_tokens[:1])
    _assert_all_match(model, prompts[:1], expected[:1], again)
    # (len - 1) // 8 full blocks are looked up: the last prompt token is always computed.
    assert llm.stats()["prefix_cache_hit_tokens"] - before == (len(prompts[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert llm.reset_prefix_cache() > 0 and llm.stats()["num_blocks_cached"] == 0


def test_eviction_under_a_small_budget_keeps_outputs(model, shared_prefix_trace, expected):
    """32 usable blocks of 8 tokens: a handful of requests fill it, so cached blocks are
    evicted (and sequences preempted) while outputs stay equal to the reference. Unrelated
    prompts in between evict the prefix's blocks, which must then be recomputed, never
    served stale."""
    prompts, max_tokens = shared_prefix_trace
    rng = random.Random(5)
    others = [[rng.randrange(3, 256) for _ in range(120)] for _ in range(2)]
    llm = _llm(model, num_blocks=33, watermark=0.0)
    outs = []
    for i in range(0, len(prompts), 4):
        got, stats = _generate(llm, prompts[i:i + 4], max_tokens[i:i + 4])
        outs += got
        _generate(llm, others, [8, 8])  # 2 x 16 blocks: every cached block is evicted
    _assert_all_match(model, prompts, expected, outs)
    assert stats["num_prefix_cache_evictions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def _sample_params(seed, n=4, max_tokens=12):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def test_parallel_sampling_reproducible_alone_and_in_a_busy_batch(model, shared_prefix_trace):
    prompts, _ = shared_prefix_trace
    prompt = prompts[3]
    llm = _llm(model, enable_prefix_caching=False)
    [alone] = llm.generate([{"prompt_token_ids": prompt}], _sample_params(11), use_tqdm=False)
    assert llm.stats()["sharing_savings"] > 0, "the four completions shared the prompt's blocks"
    busy_prompts = [{"prompt_token_ids": p} for p in prompts[4:9]]
    busy_params = [SamplingParams(n=k % 3 + 1, temperature=0.7, seed=k, max_tokens=5 + 4 * k, ignore_eos=True)
                   for k in range(len(busy_prompts))]
    outs = llm.generate(busy_prompts[:2] + [{"prompt_token_ids": prompt}] + busy_prompts[2:],
                        busy_params[:2] + [_sample_params(11)] + busy_params[2:], use_tqdm=False)
    busy = outs[2]
    assert [c.token_ids for c in busy.outputs] == [c.token_ids for c in alone.outputs]
    assert [c.index for c in alone.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 4, "four different samples"
    # Each completion equals the dense reference run with seed completion_seed(11, index).
    want = reference.generate(model.params, model.config, [prompt] * 4, max_new_tokens=12, temperature=1.0,
                              seeds=[completion_seed(11, i) for i in range(4)], ignore_eos=True)
    assert [c.token_ids for c in alone.outputs] == [list(w) for w in want]
    stats = llm.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    llm.engine.block_manager.check_invariants()


def test_greedy_n4_gives_identical_completions(model, shared_prefix_trace, expected):
    prompts, max_tokens = shared_prefix_trace
    llm = _llm(model)
    [out] = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(n=4, temperature=0.0, max_tokens=max_tokens[0], ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        _assert_all_match(model, prompts[:1], expected[:1], [c.token_ids])
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1


def test_parallel_sampling_under_preemption(model, shared_prefix_trace):
    """A pool too small for every group at once: groups are preempted (by swap and by
    recompute) and still give the same completions as alone."""
    prompts, _ = shared_prefix_trace
    params = [_sample_params(100 + i, n=3, max_tokens=30) for i in range(6)]
    requests = [{"prompt_token_ids": p} for p in prompts[:6]]
    roomy = _llm(model, enable_prefix_caching=False)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(requests, params, use_tqdm=False)]
    for mode in ("swap", "recompute"):
        tight = _llm(model, num_blocks=60, watermark=0.0, preemption_mode=mode, swap_space_bytes=2**22,
                     enable_prefix_caching=False)
        got = [[c.token_ids for c in o.outputs] for o in tight.generate(requests, params, use_tqdm=False)]
        stats = tight.stats()
        assert got == want, mode
        assert stats["num_preemptions"] > 0, (mode, stats)
        assert stats["num_blocks_free"] == stats["num_blocks_total"]
        tight.engine.block_manager.check_invariants()


def test_group_that_cannot_fit_is_refused(model):
    llm = _llm(model, num_blocks=40)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(n=4, max_tokens=100), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
