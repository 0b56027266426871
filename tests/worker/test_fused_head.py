"""The fused head (`Platform.fused_head`: the model step and its sampling head in one jitted
program, the GPU's and TPU's choice) against the split one (the CPU's): run on this CPU with
a platform that fuses, the engine's outputs equal the split runner's token for token and
logprob for logprob (greedy, seeded sampling with filters, top alternatives, n > 1, greedy
and sampled rows in one batch, structured outputs, prompt logprobs); nothing compiles after
warm-up, and a step is one jitted call."""

import functools
import itertools

import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.structured_outputs import StructuredOutputsParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.loading import load_model
from paged_jax.platform.cpu import CpuPlatform
from paged_jax.worker.model_runner import ModelRunner
from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab


class FusedCpuPlatform(CpuPlatform):
    """This machine's kernels, with the accelerators' fused head."""

    fused_head = True


def _engine(model, fused: bool, **settings) -> LLMEngine:
    platform = FusedCpuPlatform() if fused else CpuPlatform()
    engine = LLMEngine(model, EngineConfig(**settings), runner_factory=functools.partial(ModelRunner, platform=platform))
    assert engine.runner.fused_head is fused
    return engine


_REQUEST_IDS = itertools.count()


def _generate(engine: LLMEngine, prompts, params):
    """Every prompt (token ids or text) with its SamplingParams, all queued at once; outputs in order."""
    ids = [f"r{next(_REQUEST_IDS)}" for _ in params]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


def _assert_same(split_outs, fused_outs):
    """Token for token, logprob for logprob (top alternatives and prompt logprobs included)."""
    assert len(split_outs) == len(fused_outs)
    for a, b in zip(split_outs, fused_outs):
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids, (a.request_id, ca.token_ids, cb.token_ids)
            assert ca.finish_reason == cb.finish_reason
            assert (ca.logprobs is None) == (cb.logprobs is None)
            if ca.logprobs is not None:
                np.testing.assert_allclose(cb.logprobs, ca.logprobs, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(cb.cumulative_logprob, ca.cumulative_logprob, rtol=1e-5, atol=1e-4)
            assert (ca.top_logprobs is None) == (cb.top_logprobs is None)
            for ta, tb in zip(ca.top_logprobs or [], cb.top_logprobs or []):
                assert [t for t, _ in ta] == [t for t, _ in tb]
                np.testing.assert_allclose([v for _, v in tb], [v for _, v in ta], rtol=1e-5, atol=1e-5)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert list(pa) == list(pb)
                assert [x.rank for x in pa.values()] == [x.rank for x in pb.values()]
                np.testing.assert_allclose([x.logprob for x in pb.values()], [x.logprob for x in pa.values()],
                                           rtol=1e-5, atol=1e-5)


TINY = dict(block_size=8, num_blocks=96, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
            seq_buckets=(4,), token_buckets=(4, 32))


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return _engine(tiny_llama, fused=False, **TINY), _engine(tiny_llama, fused=True, **TINY)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def _both(engines, prompts, params):
    split, fused = engines
    return _generate(split, prompts, params), _generate(fused, prompts, params)


def test_greedy_with_top_logprobs(engines):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)] * 3
    params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))  # no logprobs asked
    _assert_same(*_both(engines, _prompts(4, seed=1), params))


@pytest.mark.parametrize("filters", [dict(), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.2),
                                     dict(top_k=20, top_p=0.9, min_p=0.05)])
def test_seeded_sampling_with_filters(engines, filters):
    params = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=10, ignore_eos=True, logprobs=2, **filters)
              for i in range(4)]
    split, fused = _both(engines, _prompts(4, seed=2), params)
    _assert_same(split, fused)
    assert len({tuple(o.outputs[0].token_ids) for o in fused}) > 1  # the draws differ: they were sampled


def test_n_greater_than_one(engines):
    params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=1),
              SamplingParams(n=2, temperature=0.7, top_k=10, seed=8, max_tokens=8, ignore_eos=True)]
    _assert_same(*_both(engines, _prompts(2, seed=3), params))


def test_greedy_and_sampled_rows_in_one_batch(engines):
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.2, seed=i, top_p=0.95, max_tokens=10, ignore_eos=True,
                             logprobs=2 if i < 2 else None) for i in range(4)]
    _assert_same(*_both(engines, _prompts(4, seed=4), params))


def test_prompt_logprobs(engines):
    prompts = _prompts(3, seed=5) + [list(range(3, 60))]  # a prompt longer than one 32-token chunk
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k, logprobs=1)
              for k in (0, 2, 5, 3)]
    split, fused = _both(engines, prompts, params)
    assert all(o.prompt_logprobs is not None for o in fused)
    _assert_same(split, fused)


def test_the_runner_takes_the_current_platform_by_default(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(**TINY))  # ModelRunner without a platform: this CPU's
    assert type(engine.runner.platform) is CpuPlatform and not engine.runner.fused_head


def _count_jitted_calls(runner):
    """Wrap every jitted function the runner (and its split heads) holds; returns the call list."""
    calls = []
    for owner in (runner, runner._heads):
        for name, fn in list(vars(owner).items()):
            if callable(fn) and hasattr(fn, "lower"):  # a jax.jit function
                def counted(*args, _fn=fn, _name=name, **kwargs):
                    calls.append(_name)
                    return _fn(*args, **kwargs)
                setattr(owner, name, counted)
    return calls


def test_one_jitted_call_per_step_and_no_compilation_after_warm_up(tiny_llama):
    split, fused = _engine(tiny_llama, fused=False, **TINY), _engine(tiny_llama, fused=True, **TINY)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=6, ignore_eos=True, logprobs=2)
              for i in range(4)]
    per_step = {}
    for name, engine in (("split", split), ("fused", fused)):
        calls = _count_jitted_calls(engine.runner)
        batches = []
        run_batch = engine.runner.run_batch

        def counted_run_batch(*args, _run=run_batch, _batches=batches, **kwargs):
            _batches.append(1)
            return _run(*args, **kwargs)
        engine.runner.run_batch = counted_run_batch
        _generate(engine, _prompts(4, seed=6), params)
        assert batches, "the engine ran steps"
        per_step[name] = len(calls) / len(batches)
        assert engine.stats()["num_compilations_after_warm_up"] == 0, name
    assert per_step["fused"] == 1
    assert per_step["split"] == 2  # the model step, then the head: what the counter would see unfused


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_smollm2_vocab"))
    save_tiny_smollm2_vocab(path)
    return load_model(path)


def test_structured_outputs(vocab_model):
    settings = dict(block_size=8, num_blocks=160, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                    seq_buckets=(8,), token_buckets=(8, 32))
    split, fused = _engine(vocab_model, False, **settings), _engine(vocab_model, True, **settings)
    assert split.runner.structured_outputs and fused.runner.structured_outputs
    constraints = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}(!|\?)"),
                   StructuredOutputsParams(choice=["red", "green", "blue", "dark blue"]),
                   StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), None]
    prompts = ["Answer: ", "Q: pick one.\nA:", "The sum is", "Free text"]
    params = [SamplingParams(n=2, temperature=1.0 if i % 2 == 0 else 0.0, seed=i, max_tokens=24, logprobs=2,
                             structured_outputs=c) for i, c in enumerate(constraints)]
    split_outs, fused_outs = _generate(split, prompts, params), _generate(fused, prompts, params)
    _assert_same(split_outs, fused_outs)
    assert fused_outs[1].outputs[0].text in ("red", "green", "blue", "dark blue")  # the mask held
    assert fused.stats()["num_compilations_after_warm_up"] == 0


def _conditionals(runner, batch, **static) -> int:
    """lax.cond's in the lowered fused step for `batch` (StableHLO `case` / `if` ops)."""
    text = runner._fused_step.lower(runner.params, runner.kv_cache, runner._fused_inputs(batch), runner.rope_tables,
                                    runner.packed_head, runner._feed, **static).as_text()  # static: the variant
    return text.count("stablehlo.case") + text.count("stablehlo.if")


def test_no_conditional_in_the_fused_step_its_variants_picked_on_the_host(tiny_llama):
    """With kernels that split decode steps ("xla": a decode loop, the ragged kernel otherwise)
    the fused step has a program per kind and head variant and none holds a lax.cond (a GPU
    waits on the host for a conditional's predicate); outputs equal the split runner's with
    the same kernels, which decides the kind on device."""
    settings = dict(TINY, attention_backend="xla")
    split, fused = _engine(tiny_llama, fused=False, **settings), _engine(tiny_llama, fused=True, **settings)
    runner = fused.runner
    assert runner.attention_kernels.splits_decode
    kinds = runner.step_kinds()
    assert {k for ks in kinds.values() for k in ks} == {"decode", "mixed"}
    for (num_seqs, num_tokens), shape_kinds in kinds.items():
        batch = runner.empty_batch(num_seqs, num_tokens)
        for kind in shape_kinds:
            for sample in (False, True):
                assert _conditionals(runner, batch, kind=kind, sample=sample) == 0, (num_seqs, num_tokens, kind)
    used = []
    launch_kind = runner._kind
    runner._kind = lambda batch: used.append(launch_kind(batch)) or used[-1]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, top_k=0 if i < 2 else 8, max_tokens=10,
                             ignore_eos=True, logprobs=2) for i in range(4)]
    split_outs, fused_outs = _both((split, fused), _prompts(4, seed=9), params)
    _assert_same(split_outs, fused_outs)
    assert set(used) == {"decode", "mixed"}
    assert fused.stats()["num_compilations_after_warm_up"] == 0
