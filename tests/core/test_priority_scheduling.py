"""Priority scheduling (EngineConfig.scheduling_policy="priority"), vLLM's rule.

Lower `priority` runs earlier: waiting sequences are admitted in (priority, arrival_time,
admission) order, and under memory pressure the victim is the running request with the
largest (priority, arrival_time), as vLLM v1's `max(running, key=...)`. First the
scheduler alone (queue order), then the issue's acceptance test on the model-free engine
(tests/helpers/model_free_runner.py, which also checks every K/V read), a mixed load
(n > 1, beams, arrivals, both preemption modes) checked step by step against the rule,
a small real model whose greedy outputs must not depend on the policy, and bad input.
"""

import random

import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Sequence, SequenceStatus
from paged_jax.entrypoints.llm import LLM
from paged_jax.worker.kv_cache import bytes_per_block
from tests.helpers.model_free_runner import MODEL_CONFIG, StepClock, greedy, make_engine


def _config(**kw) -> EngineConfig:
    kw.setdefault("attention_backend", "reference")  # resolved without asking jax for a platform
    if kw.get("preemption_mode") == "swap":  # a small host pool (the default's would be millions of blocks)
        kw["swap_space_bytes"] = 64 * bytes_per_block(MODEL_CONFIG, kw["block_size"], "float32")
    return EngineConfig(**kw)


# ---- the scheduler alone ------------------------------------------------------------

def _scheduler(policy: str, **kw) -> Scheduler:
    config = _config(block_size=4, max_model_len=32, scheduling_policy=policy, **kw)
    return Scheduler(config, BlockManager(64, 4, watermark=0.0))


def _seq(seq_id: int, request_id: str, priority: int, arrival: float, index: int = 0) -> Sequence:
    seq = Sequence(seq_id=seq_id, request_id=request_id, index=index, prompt_token_ids=[5, 6, 7],
                   sampling_params=SamplingParams(max_tokens=4), arrival_time=arrival, seed=0)
    seq.priority = priority
    return seq


# (request id, priority, arrival time), in the order they are added
ADDED = [("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", -1, 3.0), ("e", 1, 0.0), ("f", 0, 1.0)]


def test_waiting_queue_is_served_by_priority_then_arrival_then_admission():
    scheduler = _scheduler("priority", max_num_seqs=3, max_num_batched_tokens=32)
    for i, (rid, priority, arrival) in enumerate(ADDED):
        scheduler.add(_seq(i, rid, priority, arrival))
    # d (priority -1) first; then priority 0 by arrival (c and f tie: c was added first), then 1
    assert [s.request_id for s in scheduler.waiting] == ["d", "c", "f", "b", "a", "e"]
    out = scheduler.schedule()  # room for 3 sequences: the first three are admitted, in order
    assert [c.seq_id for c in out.chunks] == [3, 2, 5]
    assert [s.request_id for s in scheduler.running] == ["d", "c", "f"]
    assert [s.request_id for s in scheduler.waiting] == ["b", "a", "e"]


def test_fcfs_ignores_priority_and_arrival_time():
    scheduler = _scheduler("fcfs", max_num_seqs=3, max_num_batched_tokens=32)
    for i, (rid, priority, arrival) in enumerate(ADDED):
        scheduler.add(_seq(i, rid, priority, arrival))
    assert [s.request_id for s in scheduler.waiting] == ["a", "b", "c", "d", "e", "f"]
    out = scheduler.schedule()
    assert [c.seq_id for c in out.chunks] == [0, 1, 2]


def test_a_late_high_priority_request_is_admitted_before_earlier_ones_and_runs_first():
    scheduler = _scheduler("priority", max_num_seqs=2, max_num_batched_tokens=32)
    for i in range(3):
        scheduler.add(_seq(i, f"low{i}", 2, float(i)))
    scheduler.schedule()  # low0 and low1 run
    scheduler.add(_seq(3, "high", 0, 10.0))
    assert scheduler.waiting[0].request_id == "high"
    for seq in list(scheduler.running):  # they finish; high then comes before low2, and first in running
        scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
    scheduler.schedule()
    assert [s.request_id for s in scheduler.running] == ["high", "low2"]


def test_forks_queue_with_their_request():
    """A fork of a waiting sequence joins its request's key: requests stay adjacent."""
    scheduler = _scheduler("priority", max_num_seqs=4, max_num_batched_tokens=32)
    scheduler.add(_seq(0, "x", 0, 0.0))
    scheduler.add(_seq(1, "y", 0, 0.0))
    scheduler.add(_seq(2, "z", 1, 0.0))
    child = _seq(3, "x", 0, 0.0, index=1)
    scheduler.fork(scheduler.waiting[0], child)
    assert [s.seq_id for s in scheduler.waiting] == [0, 3, 1, 2]


# ---- the model-free engine ----------------------------------------------------------

def _serve(config, requests, *, check=None, setup=None, max_steps=5_000):
    """Feed `requests` ((request id, prompt, params, priority, arrival step, arrival time))
    to a model-free engine until idle; `setup(engine)` first, `check(engine)` after each
    step. Returns (ids in finishing order, outputs by id, request ids of the preempted
    sequences in preemption order, the engine)."""
    clock = StepClock()
    engine = make_engine(config, clock)
    if setup is not None:
        setup(engine)
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        preempted.extend(engine.core._seqs[i].request_id for i in out.preempted_seq_ids)
        return out

    engine.scheduler.schedule = recording_schedule
    pending = sorted(requests, key=lambda r: r[4])
    order, outputs, step = [], {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            rid, prompt, params, priority, _, arrival = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params, priority=priority,
                               arrival_time=arrival)
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    order.append(out.request_id)
                    outputs[out.request_id] = out
            if check is not None:
                check(engine)
        step += 1
        clock.now = float(step)
        assert step < max_steps, engine.stats()
    return order, outputs, preempted, engine


def _acceptance_requests(low: int, high: int):
    """Four requests of priority `low` submitted first (arrival times 0..3), one of
    priority `high` last (arrival time 4): each needs 6 of the 12 usable blocks at its end."""
    lows = [(f"low{i}", (5 + i,) * 8, greedy(16), low, 0, float(i)) for i in range(4)]
    return lows + [("high", (9,) * 8, greedy(16), high, 0, 4.0)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_request_finishes_first_and_only_low_priority_ones_are_preempted(mode):
    """The issue's acceptance test: a KV budget that forces preemption (13 blocks of 4
    tokens for five requests of 24), low-priority requests first, a high-priority one last."""
    config = _config(block_size=4, num_blocks=13, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=32,
                     watermark=0.0, preemption_mode=mode, scheduling_policy="priority")
    order, outputs, preempted, engine = _serve(config, _acceptance_requests(low=5, high=0),
                                               check=lambda e: e.block_manager.check_invariants())
    assert sorted(order) == ["high", "low0", "low1", "low2", "low3"]
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs.values())
    assert order[0] == "high"
    assert preempted, "the budget must force preemption"
    assert "high" not in preempted
    assert set(preempted) <= {"low0", "low1", "low2", "low3"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks

    # the same load under FCFS (where every priority is 0): the last submitted is preempted first
    fcfs = _config(block_size=4, num_blocks=13, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=32,
                   watermark=0.0, preemption_mode=mode)
    order, _, preempted, _ = _serve(fcfs, _acceptance_requests(low=0, high=0))
    assert order[-1] == "high" and "high" in preempted


def _key(seq):
    return seq.priority, seq.arrival_time


def _check_queues(engine, priorities: dict[str, int]):
    """Every queue in key order, a request's sequences adjacent, forks with their
    request's priority, and the block manager's invariants."""
    scheduler = engine.scheduler
    engine.block_manager.check_invariants()
    waiting, running = list(scheduler.waiting), scheduler.running
    swapped = [group[0] for group in scheduler.swapped]
    for queue in (waiting, running, swapped):
        keys = [_key(s) for s in queue]
        assert keys == sorted(keys), [(s.request_id, _key(s)) for s in queue]
    for queue in (waiting, running):
        runs = [s.request_id for i, s in enumerate(queue) if i == 0 or queue[i - 1].request_id != s.request_id]
        assert len(runs) == len(set(runs)), f"a request's sequences are split: {[s.request_id for s in queue]}"
    for group in scheduler.swapped:
        assert len({s.request_id for s in group}) == 1
    for seq in waiting + running + [s for g in scheduler.swapped for s in g]:
        assert seq.priority == priorities[seq.request_id], (seq.request_id, seq.index)


def _victims_follow_the_rule(engine, log: list):
    """Wrap schedule(): the requests preempted in a step are, one after another, those with
    the largest (priority, arrival_time) among the running ones (vLLM v1's victim)."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule

    def checked():
        running = {s.request_id: _key(s) for s in scheduler.running}
        out = schedule()
        victims = []
        for seq_id in out.preempted_seq_ids:
            rid = engine.core._seqs[seq_id].request_id
            if not victims or victims[-1] != rid:
                victims.append(rid)
        for rid in victims:
            assert running[rid] == max(running.values()), (rid, running)
            del running[rid]
        log.extend(victims)
        return out

    scheduler.schedule = checked


@pytest.mark.parametrize("mode, chunked", [("recompute", True), ("swap", True), ("recompute", False)])
def test_mixed_load_keeps_the_rule_at_every_step(mode, chunked):
    """Random arrivals and priorities, n > 1 and beams, in a pool that keeps preempting:
    every request finishes, queues stay in key order with requests adjacent, forks and
    beams carry their request's priority, and every victim is the rule's."""
    rng = random.Random(7)
    requests, priorities = [], {}
    for i in range(20):
        rid = f"r{i}"
        priorities[rid] = rng.choice([-1, 0, 0, 1, 2])
        prompt = tuple(rng.randrange(3, 60) for _ in range(rng.randint(2, 9)))
        if i % 5 == 4:
            params = BeamSearchParams(beam_width=2, max_tokens=rng.randint(2, 8), ignore_eos=True)
        else:
            # within the context left (max_model_len 20): more is refused (processor.validate_max_tokens)
            params = greedy(min(rng.randint(4, 14), 20 - len(prompt)), n=rng.choice([1, 1, 2, 3]))
        step = rng.randint(0, 8)
        requests.append((rid, prompt, params, priorities[rid], step, float(step)))
    config = _config(block_size=2, num_blocks=32, max_model_len=20, max_num_seqs=6, max_num_batched_tokens=20,
                     watermark=0.0, preemption_mode=mode, enable_chunked_prefill=chunked,
                     scheduling_policy="priority")
    victims: list[str] = []
    order, outputs, preempted, engine = _serve(config, requests, check=lambda e: _check_queues(e, priorities),
                                               setup=lambda e: _victims_follow_the_rule(e, victims))
    assert sorted(order) == sorted(priorities)
    assert preempted and victims, "the pool must force preemption"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
    assert not engine.scheduler.priority._admission, "finished requests' keys are forgotten"


# ---- a real model -------------------------------------------------------------------

SETTINGS = dict(block_size=4, num_blocks=24, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32,
                seq_buckets=(4,), token_buckets=(32,), watermark=0.0)


@pytest.fixture(scope="module")
def priority_llm(tiny_llama):
    return LLM(tiny_llama, scheduling_policy="priority", **SETTINGS)


def test_greedy_outputs_under_priority_equal_fcfs(tiny_llama, priority_llm):
    """Priority changes the order of service and the victims, never a token: the same
    greedy requests under a budget that preempts give the same outputs as FCFS."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 256) for _ in range(rng.randint(3, 20))]} for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24), ignore_eos=True) for _ in prompts]
    fcfs = LLM(tiny_llama, **SETTINGS)
    want = fcfs.generate(prompts, params, use_tqdm=False)
    before = priority_llm.stats()["num_preemptions"]
    got = priority_llm.generate(prompts, params, use_tqdm=False, priority=[3, 2, 1, 0, -1, 0])
    assert priority_llm.stats()["num_preemptions"] > before, "the budget must force preemption"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert fcfs.stats()["num_preemptions"] > 0


# ---- bad input ----------------------------------------------------------------------

def test_bad_policy_name():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lottery")
    assert EngineConfig().scheduling_policy == "fcfs"


def test_priority_needs_the_priority_policy():
    engine = make_engine(_config(block_size=4, num_blocks=16, max_model_len=32))
    with pytest.raises(ValueError, match="requires scheduling_policy='priority'"):
        engine.add_request("a", [5, 6], greedy(2), priority=1)
    assert not engine.has_unfinished_requests()
    engine.add_request("b", [5, 6], greedy(2), priority=0)  # 0 is every request's priority under FCFS
    assert engine.has_unfinished_requests()


@pytest.mark.parametrize("priority", [True, 1.0, "1", None])
def test_priority_must_be_an_int(priority):
    engine = make_engine(_config(block_size=4, num_blocks=16, max_model_len=32, scheduling_policy="priority"))
    with pytest.raises(ValueError, match="priority must be an int"):
        engine.add_request("a", [5, 6], greedy(2), priority=priority)
    assert not engine.has_unfinished_requests()
    engine.add_request("b", [5, 6], greedy(2), priority=np.int64(-3))
    assert engine.scheduler.waiting[0].priority == -3 and type(engine.scheduler.waiting[0].priority) is int


def test_generate_checks_its_priorities(tiny_llama, priority_llm):
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        priority_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="one per prompt"):
        priority_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=1)
    with pytest.raises(ValueError, match="priority must be an int"):
        priority_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 0.5])
    assert not priority_llm.engine.has_unfinished_requests(), "all or nothing: the first one was aborted"
    out = priority_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
