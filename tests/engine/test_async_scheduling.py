"""Async scheduling (EngineConfig.async_scheduling) against stepping in sequence.

With async scheduling the engine schedules and dispatches step N+1 before it reads step N's
tokens; sequences N sampled for run in N+1 with their token pending (the device feeds it).
Outputs must not change: every mode here runs the same requests through an engine stepping
in sequence and one scheduling ahead, on the CPU's split head and on the accelerators'
fused one (a platform that fuses, on this CPU), and compares token for token and logprob
for logprob: greedy and seeded sampling, n > 1, logprobs and prompt logprobs, stop tokens,
beams, structured outputs, priorities, prefix caching across requests, preemption by
recompute and by swap, and aborts while a step is in flight. Each run also checks that
steps did overlap (a step was dispatched before the one before it was read, its pending
tokens fed from the device), that every block came back once, and that nothing compiled
after warm-up. The paged engine against the dense reference under async scheduling is in
test_engine.py.
"""

import functools
import itertools

import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
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


TINY = dict(block_size=8, num_blocks=96, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
            seq_buckets=(4,), token_buckets=(4, 32), pool_check="step")
_IDS = itertools.count()


class _Trace:
    """Wraps a runner's dispatch / fetch / execute to record their order and the fed tokens."""

    def __init__(self, runner):
        self.events, self.fed, self.swapped_out = [], 0, 0
        for name in ("dispatch", "fetch", "execute"):
            setattr(runner, name, self._wrap(name, getattr(runner, name)))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.events.append(name)
            if name != "fetch":
                self.swapped_out += len(args[0].swap_out)
            if name == "dispatch":
                self.fed += int((out.batch.feed_rows >= 0).sum())
            return out
        return wrapped

    @property
    def overlapped(self) -> int:
        """Steps dispatched while the one before was still unread."""
        count, unread = 0, 0
        for event in self.events:
            if event == "dispatch":
                count += unread > 0
                unread += 1
            elif event == "fetch":
                unread -= 1
        return count


def _engine(model, async_scheduling: bool, fused: bool = False, **settings) -> LLMEngine:
    platform = FusedCpuPlatform() if fused else CpuPlatform()
    config = EngineConfig(**{**TINY, **settings}, async_scheduling=async_scheduling)
    engine = LLMEngine(model, config, runner_factory=functools.partial(ModelRunner, platform=platform))
    assert engine.core.async_scheduling is async_scheduling
    engine.trace = _Trace(engine.runner)
    return engine


def _generate(engine: LLMEngine, prompts, params, priorities=None, abort_after=None):
    """Every prompt with its params queued at once; the finished outputs in order (aborted: None).
    `abort_after`: {request index: steps after which to abort it}."""
    ids = [f"r{next(_IDS)}" for _ in params]
    for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params)):
        prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        engine.add_request(request_id, prompt, p, **({"priority": priorities[i]} if priorities else {}))
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        for i, after in (abort_after or {}).items():
            if steps == after:
                engine.abort_request(ids[i])
    stats = engine.core.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"], "every block came back"
    assert stats["num_pool_check_failures"] == 0
    assert stats["num_compilations_after_warm_up"] == 0
    engine.block_manager.check_invariants()
    return [finished.get(i) for i in ids]


def _assert_same(sync_outs, async_outs):
    assert len(sync_outs) == len(async_outs)
    for a, b in zip(sync_outs, async_outs):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids, (a.request_id, ca.token_ids, cb.token_ids)
            assert ca.finish_reason == cb.finish_reason and ca.stop_reason == cb.stop_reason
            assert ca.text == cb.text
            assert (ca.logprobs is None) == (cb.logprobs is None)
            if ca.logprobs is not None:
                np.testing.assert_allclose(cb.logprobs, ca.logprobs, rtol=1e-5, atol=1e-5)
            for ta, tb in zip(ca.top_logprobs or [], cb.top_logprobs or []):
                assert [t for t, _ in ta] == [t for t, _ in tb]
            if ca.score is not None:
                np.testing.assert_allclose(cb.score, ca.score, rtol=1e-5, atol=1e-5)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert list(pa) == list(pb)
        assert a.num_cached_tokens == b.num_cached_tokens


def _prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=[False, True], ids=["split-head", "fused-head"])
def engines(request, tiny_llama):
    return _engine(tiny_llama, False, request.param), _engine(tiny_llama, True, request.param)


def _both(engines, *args, **kwargs):
    sync, async_ = engines
    async_.trace.events.clear()
    for engine in engines:  # the same cache state for both (num_cached_tokens is compared)
        engine.core.reset_prefix_cache()
    return _generate(sync, *args, **kwargs), _generate(async_, *args, **kwargs)


def test_greedy_and_sampled_with_logprobs(engines):
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, top_p=0.9, max_tokens=14, ignore_eos=True,
                             logprobs=2 if i < 3 else None, prompt_logprobs=1 if i == 0 else None) for i in range(6)]
    sync, async_ = _both(engines, _prompts(6, seed=1), params)
    _assert_same(sync, async_)
    trace = engines[1].trace
    assert trace.overlapped > 5 and trace.fed > 20, (trace.overlapped, trace.fed)
    assert "execute" not in trace.events
    assert "dispatch" not in engines[0].trace.events  # the switch off: strictly in sequence


def test_n_greater_than_one_and_stop_tokens(engines):
    # stop tokens the model does sample: the request ends at the first, mid-run, and nothing after it shows
    probe = _generate(engines[0], _prompts(3, seed=3), [SamplingParams(temperature=0.0, max_tokens=12,
                                                                       ignore_eos=True)] * 3)
    stops = [out.outputs[0].token_ids[5] for out in probe]
    params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stops[1]]),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stops[2]])]
    sync, async_ = _both(engines, _prompts(3, seed=3), params)
    _assert_same(sync, async_)
    for out, stop in zip(async_[1:], stops[1:]):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids[-1] == stop


def test_beam_search_and_priorities(engines):
    params = [BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    sync, async_ = _both(engines, _prompts(3, seed=4), params)
    _assert_same(sync, async_)


def test_priorities(tiny_llama):
    settings = dict(scheduling_policy="priority", num_blocks=24, max_num_seqs=4)  # tight: preemptions
    sync, async_ = _engine(tiny_llama, False, **settings), _engine(tiny_llama, True, **settings)
    prompts = _prompts(8, seed=5, lo=20, hi=40)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 8
    priorities = [3, 1, 2, 0, 3, 1, 0, 2]
    _assert_same(_generate(sync, prompts, params, priorities), _generate(async_, prompts, params, priorities))
    assert async_.core.stats()["num_preemptions"] > 0 and async_.trace.overlapped > 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tiny_llama, mode):
    settings = dict(num_blocks=24, max_num_seqs=4, preemption_mode=mode, swap_space_bytes=16 * 2**20)
    sync, async_ = _engine(tiny_llama, False, **settings), _engine(tiny_llama, True, **settings)
    prompts = _prompts(8, seed=6, lo=10, hi=40)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(8)]
    _assert_same(_generate(sync, prompts, params), _generate(async_, prompts, params))
    stats = async_.core.stats()
    assert stats["num_preemptions"] > 0 and async_.trace.overlapped > 10
    if mode == "swap":
        assert async_.trace.swapped_out > 0


def test_prefix_caching_across_requests(tiny_llama):
    """A second turn whose prompt is the first turn's prompt and output: the blocks holding
    output tokens (which async scheduling computed while their ids were still on the device)
    are cached once their ids are read, and the second turn hits them as without async."""
    prompts = _prompts(3, seed=7, lo=5, hi=12)
    first = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3
    second = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 3
    results = []
    for async_scheduling in (False, True):
        engine = _engine(tiny_llama, async_scheduling)
        turn1 = _generate(engine, prompts, first)
        turn2 = _generate(engine, [p + o.outputs[0].token_ids for p, o in zip(prompts, turn1)], second)
        assert all(o.num_cached_tokens >= 32 for o in turn2), [o.num_cached_tokens for o in turn2]
        results.append(turn1 + turn2)
    _assert_same(*results)


def test_aborts_while_a_step_is_in_flight(engines):
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 4
    sync, async_ = _both(engines, _prompts(4, seed=8), params, abort_after={0: 3, 2: 7})
    assert sync[0] is None and sync[2] is None
    _assert_same(sync, async_)


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_smollm2_vocab"))
    save_tiny_smollm2_vocab(path)
    return load_model(path)


@pytest.mark.parametrize("fused", [False, True], ids=["split-head", "fused-head"])
def test_structured_outputs_and_stop_strings(vocab_model, fused):
    settings = dict(num_blocks=160, max_model_len=256, max_num_seqs=8, seq_buckets=(8,), token_buckets=(8, 32))
    sync, async_ = _engine(vocab_model, False, fused, **settings), _engine(vocab_model, True, fused, **settings)
    constraints = [StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}(!|\?)"),
                   StructuredOutputsParams(choice=["red", "green", "blue", "dark blue"]), None, None]
    prompts = ["Answer: ", "Q: pick one.\nA:", "The sum is", "Free text"]
    params = [SamplingParams(n=2 if c else 1, temperature=1.0 if i % 2 == 0 else 0.0, seed=i, max_tokens=24,
                             logprobs=2, structured_outputs=c) for i, c in enumerate(constraints)]
    # a stop string the model writes: the text ends before it, and no token past it shows
    probe = _generate(sync, prompts[3:], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)])
    stop = probe[0].outputs[0].text[4:7]
    params[3] = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    sync_outs, async_outs = _generate(sync, prompts, params), _generate(async_, prompts, params)
    _assert_same(sync_outs, async_outs)
    assert async_outs[1].outputs[0].text in ("red", "green", "blue", "dark blue")
    assert async_outs[3].outputs[0].finish_reason == "stop" and stop not in async_outs[3].outputs[0].text
    assert async_.trace.overlapped > 0  # the unconstrained rows' steps still overlapped


def test_a_runner_without_dispatch_is_refused_when_asked(tiny_llama):
    class SyncOnly(ModelRunner):
        dispatch = None

    with pytest.raises(ValueError, match="async_scheduling=True needs a runner"):
        LLMEngine(tiny_llama, EngineConfig(**TINY, async_scheduling=True), runner_factory=SyncOnly)


def test_async_scheduling_must_be_a_bool():
    with pytest.raises(ValueError, match="async_scheduling must be"):
        EngineConfig(async_scheduling="yes")
