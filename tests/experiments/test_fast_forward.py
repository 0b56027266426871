"""The simulator's fast-forward (experiments/simulator/fast_forward.py) changes nothing.

It claims that applying runs of quiet decode steps directly leaves the engine exactly
where stepping them one by one would: so each case runs one trace twice, step by step
and fast-forwarded, records the engine's state before every schedule() the real engine
runs (clock, every running sequence's progress and block table, the queues, the free
and cached block counts), and compares the fast run's records with the step-by-step
run's at the same step number, then every request's times and the final stats. The
cases cover what ends a quiet run: arrivals, finishes, preemption (recompute and swap),
admission once blocks free up, chunked prefills continuing while others decode,
prefix-cache hits and evictions, priority order, a
bucketed step-time model and block size 1.
(The "priority" case's requests carry no priority: that policy's queue order with ties
broken by arrival; "distinct-priorities" gives them three.)
"""

import dataclasses
import math

import numpy as np
import pytest

import configs
from experiments.benchmarks.workloads import make_trace
from experiments.simulator.simulator import Simulator
from experiments.simulator.step_time_model import StepTimeModel
from paged_jax.config.engine_config import EngineConfig

STEP_MODEL = StepTimeModel(intercept_s=0.01, per_token_s=0.002, per_seq_s=0.003, per_context_token_s=1e-4)
# paper_metrics: the fast-forward's incrementally kept utilization, waste and sharing sums are compared too
BASE = {"block_size": 4, "max_model_len": 96, "max_num_seqs": 6, "max_num_batched_tokens": 32, "paper_metrics": True,
        "attention_backend": "reference"}
CASES = {
    "ample-blocks": {"num_blocks": 400},
    "recompute-preemption": {"num_blocks": 40},
    "swap-preemption": {"num_blocks": 40, "preemption_mode": "swap"},
    "prefix-caching": {"num_blocks": 48, "enable_prefix_caching": True},
    "priority": {"num_blocks": 40, "scheduling_policy": "priority"},
    "block-size-1": {"num_blocks": 160, "block_size": 1},
    "bucketed": {"num_blocks": 40, "seq_buckets": (2, 4, 6), "token_buckets": (8, 32)},
    "chunked-prefill": {"num_blocks": 60, "max_num_batched_tokens": 8},  # most prompts take several chunks
    # every third request samples one token: it finishes in its prefill step, some beside decodes that finish
    "one-token-outputs": {"num_blocks": 40},
    # requests of three priorities: admissions go before running sequences of a later priority
    "distinct-priorities": {"num_blocks": 40, "scheduling_policy": "priority"},
}
# why a lazy run must end inside advance() (which then goes on), at least so often in the
# case: an admission inserted before the running tail ends the run after its step
MIN_RUN_ENDS = {"distinct-priorities": {"inserted": 3}}
# steps of each special kind the case must fast-forward: a chunked prefill's continuation,
# decodes that preempt (recompute or swap)
MIN_PREFILL_STEPS = {"chunked-prefill": 30}
MIN_PREEMPTING_STEPS = {"recompute-preemption": 15, "swap-preemption": 8, "prefix-caching": 15}
IGNORED = {"host_seconds_per_step", "host_fraction", "saturated_tokens_per_s", "wall_seconds", "cpu_seconds"}


def _trace(shared_prefix: bool, one_token_outputs: bool = False, priorities: bool = False):
    trace = make_trace("alpaca", 40, seed=5, scale=0.6, max_model_len=96, vocab_size=256, request_rate=6.0)
    if priorities:  # half at t = 0 of the last priority; the rest arrive later, wait for room, and go before them
        trace = [dataclasses.replace(r, priority=2, arrival_time=0.0) if i < len(trace) // 2
                 else dataclasses.replace(r, priority=i % 2) for i, r in enumerate(trace)]
    if one_token_outputs:  # all at t = 0: a finish frees a row, the next step admits into it
        trace = [dataclasses.replace(r, max_tokens=1 if i % 3 == 0 else r.max_tokens, arrival_time=0.0)
                 for i, r in enumerate(trace)]
    if shared_prefix:  # 3 system prompts of 12 tokens before each prompt: hits, and evictions under pressure
        rng = np.random.default_rng(1)
        systems = [list(rng.integers(4, 256, 12)) for _ in range(3)]
        trace = [dataclasses.replace(r, prompt_token_ids=[int(t) for t in systems[i % 3]] + list(r.prompt_token_ids),
                                     max_tokens=min(r.max_tokens, 96 - 12 - len(r.prompt_token_ids)))  # fits
                 for i, r in enumerate(trace)]
    return trace


class _Recorder:
    """Each real schedule()'s output and the engine's state right after it, by step number
    (a step the fast-forward hands over has its allocations made before schedule(), so
    the state is compared once the step's allocations are all made)."""

    def __init__(self, sim):
        self.states = {}
        core = sim.engine.core
        schedule = core.scheduler.schedule

        def recording():
            output = schedule()
            s, bm = core.scheduler, core.block_manager
            self.states[core.stats_tracker.num_steps] = (
                sim.clock.now, output,
                [(q.seq_id, q.num_computed_tokens, tuple(q.output_token_ids), tuple(bm.block_table(q.seq_id)),
                  bm.num_tokens(q.seq_id)) for q in s.running],
                [q.seq_id for q in s.waiting], [[q.seq_id for q in g] for g in s.swapped],
                bm.num_free_blocks, bm.num_blocks_cached, bm.num_evictions, s.num_preemptions)
            return output
        core.scheduler.schedule = recording


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_forward_leaves_the_engine_where_step_by_step_does(case):
    options = {**BASE, **CASES[case]}
    step_model = dataclasses.replace(STEP_MODEL, bucketed=True) if "seq_buckets" in options else STEP_MODEL
    trace = _trace(options.get("enable_prefix_caching", False), case == "one-token-outputs",
                   case == "distinct-priorities")
    config = EngineConfig(**options)
    runs = {}
    for fast in (False, True):
        sim = Simulator(trace, config, step_model, configs.get_config("tiny_llama"), fast_forward=fast)
        recorder = _Recorder(sim)
        figures = sim.run()
        runs[fast] = sim, recorder.states, figures
    slow_sim, slow_states, slow_figures = runs[False]
    fast_sim, fast_states, fast_figures = runs[True]
    assert fast_sim.fast_forward.num_steps > 0.3 * slow_figures["num_steps"], "the case has quiet runs to skip"
    assert fast_sim.fast_forward.num_prefill_steps >= MIN_PREFILL_STEPS.get(case, 0)
    assert fast_sim.fast_forward.num_preempting_steps >= MIN_PREEMPTING_STEPS.get(case, 0)
    assert fast_sim.fast_forward.num_finishing_steps >= len(trace) // 4, "steps that finish requests are applied"
    assert fast_sim.fast_forward.num_admitting_steps >= len(trace) // 5, "steps that admit requests are applied"
    for reason, least in MIN_RUN_ENDS.get(case, {}).items():
        assert fast_sim.fast_forward.runs_resumed.get(reason, 0) >= least, fast_sim.fast_forward.runs_resumed
    assert len(fast_states) + fast_sim.fast_forward.num_steps == len(slow_states)  # lean steps call schedule()
    for step, state in fast_states.items():
        assert state == slow_states[step], f"state before step {step}"
    assert fast_sim.times == slow_sim.times
    assert sorted(slow_sim.times) == list(range(len(trace)))
    for key, value in slow_figures.items():
        if key not in IGNORED:
            assert fast_figures[key] == value or (isinstance(value, float) and math.isclose(
                fast_figures[key], value, rel_tol=1e-12)), key
