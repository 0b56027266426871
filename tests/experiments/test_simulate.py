"""The simulator (experiments/simulate.py) and its step-time model.

The simulator claims to make exactly the real engine's decisions with the model taken
out. The main test runs one small trace with arrivals through (a) the simulator and (b) a
real LLMEngine with the tiny random-weight Llama, whose runner advances the same virtual
clock by the same step-time model (computed here, independently), and compares every
step: which sequences ran, how many tokens each, from which position, and what was
preempted. Then the latency arithmetic on a trace small enough to do by hand, and the
least-squares fit on synthetic steps with known coefficients.
"""

import dataclasses

import numpy as np
import pytest

import configs
from experiments.benchmarks.workloads import Request, fluid_ratio, make_trace
from experiments.simulator.simulator import Simulator, latency_figures
from experiments.simulator.step_time_model import StepTimeModel, fit_error
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.allocators import make_allocator
from paged_jax.worker.model_runner import ModelRunner

# one compiled shape: every step pads to 4 rows x 32 tokens
TINY = {"block_size": 4, "max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32, "seq_buckets": (4,),
        "token_buckets": (32,), "attention_backend": "reference", "paper_metrics": True}
STEP_MODEL = StepTimeModel(intercept_s=0.01, per_token_s=0.002, per_seq_s=0.003, per_context_token_s=1e-4)


def _step_seconds(output) -> float:
    """STEP_MODEL's time for a step, computed here rather than by the simulator's code."""
    tokens = sum(len(c.token_ids) for c in output.chunks)
    context = sum(c.start_position + len(c.token_ids) for c in output.chunks)
    return 0.01 + 0.002 * tokens + 0.003 * len(output.chunks) + 1e-4 * context


def _record(engine, clock) -> list:
    """Wrap the engine's scheduler so every step's decisions are logged."""
    log, schedule = [], engine.scheduler.schedule

    def recording():
        output = schedule()
        log.append((round(clock(), 9), tuple((c.seq_id, c.num_tokens, c.start_position) for c in output.chunks),
                    output.preempted_seq_ids, len(output.swap_out), len(output.swap_in)))
        return output
    engine.scheduler.schedule = recording
    return log


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_real_engine(loaded, trace, config):
    """The real engine (model and all) fed `trace` at virtual arrival times; its runner
    advances the clock by the step-time model after each step."""
    clock = _Clock()

    class TickingRunner(ModelRunner):
        def execute(self, output, seqs):
            result = super().execute(output, seqs)
            clock.now += _step_seconds(output)
            return result

    engine = LLMEngine(loaded, config, runner_factory=TickingRunner, clock=clock, allocator_factory=make_allocator)
    log = _record(engine, clock)
    times, i = {}, 0
    while i < len(trace) or engine.has_unfinished_requests():
        while i < len(trace) and trace[i].arrival_time <= clock.now:
            engine.add_request(f"r{i}", {"prompt_token_ids": list(trace[i].prompt_token_ids)},
                               SamplingParams(max_tokens=trace[i].max_tokens, ignore_eos=True, temperature=0.0),
                               arrival_time=trace[i].arrival_time)
            i += 1
        if not engine.has_unfinished_requests():
            clock.now = trace[i].arrival_time
            continue
        for out in engine.step():
            if out.finished:
                m = out.metrics
                times[int(out.request_id[1:])] = (m["arrival_time"], m["first_token_time"], m["finish_time"],
                                                  len(out.outputs[0].token_ids))
    return log, times, engine.stats()


CASES = {
    "paged": {"num_blocks": 64},
    "paged-recompute-preemption": {"num_blocks": 20},
    "paged-swap-preemption": {"num_blocks": 20, "preemption_mode": "swap"},
    "contiguous-max": {"num_blocks": 40, "kv_allocator": "contiguous-max"},
    "contiguous-pow2": {"num_blocks": 40, "kv_allocator": "contiguous-pow2"},
}


@pytest.fixture(scope="module")
def trace():
    # ~6-token prompts, ~17-token outputs (max 64), bursts of Poisson arrivals on the virtual clock
    return make_trace("alpaca", 14, seed=3, scale=0.3, max_model_len=64, vocab_size=256, request_rate=25.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_simulated_schedule_equals_the_real_engines(case, trace, tiny_llama):
    config = EngineConfig(**TINY, **CASES[case])
    real_log, real_times, real_stats = _run_real_engine(tiny_llama, trace, config)

    # every step through schedule(), so each is logged (test_fast_forward.py: the fast-forward changes nothing)
    sim = Simulator(trace, config, STEP_MODEL, configs.get_config("tiny_llama"), fast_forward=False)
    sim_log = _record(sim.engine, sim.clock)
    figures = sim.run()

    assert sim_log == real_log
    assert sorted(sim.times) == sorted(real_times) == list(range(len(trace)))
    assert [dataclasses.astuple(sim.times[i]) for i in range(len(trace))] == [
        pytest.approx(real_times[i]) for i in range(len(trace))]
    for key in ("kv_utilization", "num_preemptions", "num_steps", "mean_batched_seqs", "max_batched_seqs",
                "waste_internal_slots", "waste_reservation_slots", "waste_external_slots"):
        assert figures[key] == pytest.approx(real_stats[key]), key
    assert figures["num_requests"] == len(trace)
    assert figures["output_tokens"] == sum(r.max_tokens for r in trace)
    if "preemption" in case:  # the tight budgets do exercise preemption
        assert real_stats["num_preemptions"] > 0
        assert any(swaps for *_, swaps_out, swaps in real_log) == (case == "paged-swap-preemption")


def test_allocators_schedule_differently(trace):
    """The comparison above can tell allocators apart: their schedules differ."""
    logs = {}
    for case in ("paged", "contiguous-max"):
        sim = Simulator(trace, EngineConfig(**TINY, **CASES[case]), STEP_MODEL, configs.get_config("tiny_llama"),
                        fast_forward=False)
        logs[case] = _record(sim.engine, sim.clock)
        sim.run()
    assert logs["paged"] != logs["contiguous-max"]


def test_latency_figures_on_a_hand_computed_trace():
    # Steps cost 0.1 s per computed token (nothing else). Requests: A (3-token prompt, 2
    # outputs) and B (5, 3) at t=0; C (2, 1) at t=5.
    #   step 1 [0.0, 0.8]: prefill A (3) + B (5) = 8 tokens; A and B sample token 1 at 0.8
    #   step 2 [0.8, 1.0]: decode A, B; A has 2 tokens: finishes at 1.0
    #   step 3 [1.0, 1.1]: decode B; B has 3 tokens: finishes at 1.1
    #   idle until 5.0; step 4 [5.0, 5.2]: prefill C (2); C has 1 token: finishes at 5.2
    trace = [Request((5, 6, 7), 2, 0.0), Request((8, 9, 10, 11, 12), 3, 0.0), Request((13, 14), 1, 5.0)]
    model = StepTimeModel(intercept_s=0.0, per_token_s=0.1, per_seq_s=0.0, per_context_token_s=0.0)
    sim = Simulator(trace, EngineConfig(**TINY, num_blocks=64), model, configs.get_config("tiny_llama"))
    figures = sim.run()
    assert [x for i in range(3) for x in dataclasses.astuple(sim.times[i])] == pytest.approx(
        [0.0, 0.8, 1.0, 2, 0.0, 0.8, 1.1, 3, 5.0, 5.2, 5.2, 1])
    assert figures["num_steps"] == 4
    assert figures["num_requests"] == 3 and figures["output_tokens"] == 6
    assert figures["virtual_seconds"] == pytest.approx(5.2)
    assert figures["requests_per_s"] == pytest.approx(3 / 5.2)
    assert figures["output_tokens_per_s"] == pytest.approx(6 / 5.2)
    # normalized latency: A 1.0 / 2, B 1.1 / 3, C 0.2 / 1
    assert figures["mean_normalized_latency_s"] == pytest.approx((0.5 + 1.1 / 3 + 0.2) / 3)
    # TTFT 0.8, 0.8, 0.2: p50 0.8; p90 and p99 too (the top two are equal)
    assert figures["ttft_s_p50"] == pytest.approx(0.8) and figures["ttft_s_p99"] == pytest.approx(0.8)
    # TPOT: A (1.0 - 0.8) / 1 = 0.2, B (1.1 - 0.8) / 2 = 0.15; C has one token, none.
    # Linear interpolation between 0.15 and 0.2: p50 0.175, p90 0.195, p99 0.1995.
    assert [figures[f"tpot_s_p{q}"] for q in (50, 90, 99)] == pytest.approx([0.175, 0.195, 0.1995])


def test_latency_figures_of_nothing():
    assert latency_figures([]) == {"num_requests": 0}


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 512, 200)
    seqs = np.minimum(rng.integers(1, 64, 200), tokens)
    context = tokens * rng.integers(1, 40, 200)
    features = np.stack([tokens, seqs, context], axis=1)
    true = StepTimeModel(intercept_s=0.02, per_token_s=1.5e-3, per_seq_s=4e-4, per_context_token_s=2e-6)
    seconds = true.predict(features) * rng.normal(1.0, 0.01, 200)  # 1% noise
    fitted = StepTimeModel.fit(features, seconds)
    for name in ("intercept_s", "per_token_s", "per_seq_s", "per_context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.1), name
    error = fit_error(fitted, features, seconds)
    assert error["mean_relative_error"] < 0.02 and error["total_relative_error"] < 0.01


def test_fit_keeps_coefficients_non_negative():
    # time falls with num_seqs in this data; an unconstrained fit would say per_seq < 0
    features = np.array([[t, s, 0] for t in (8, 16, 32, 64) for s in (1, 4, 8)])
    seconds = 0.01 + 1e-3 * features[:, 0] - 2e-4 * features[:, 1]
    unconstrained = np.linalg.lstsq(np.c_[np.ones(len(features)), features[:, :2]], seconds, rcond=None)[0]
    assert unconstrained[2] < 0
    fitted = StepTimeModel.fit(features, seconds)
    assert fitted.per_seq_s == 0.0 and fitted.per_token_s > 0 and fitted.intercept_s > 0


def test_model_json_round_trip(tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"figures": {"model": {"intercept_s": 0.1, "per_token_s": 0.2, "per_seq_s": 0.3, '
                    '"per_context_token_s": 0.4, "source": "x"}}}')
    assert StepTimeModel.load(str(path)) == StepTimeModel(0.1, 0.2, 0.3, 0.4, source="x")
    with pytest.raises(ValueError, match="per_seq_s"):
        StepTimeModel(0.1, 0.2, -0.3, 0.4)


def test_block_manager_growth_inside_the_last_block():
    """BlockManager.allocate_slots has a fast path for growth inside the last block (most
    decode steps, millions per simulation): it must still register a block it fills in
    the prefix cache, and must not skip the copy-on-write of a shared last block."""
    from paged_jax.core.block_manager import BlockManager
    tokens = list(range(10, 30))
    bm = BlockManager(8, 4, watermark=0.0, enable_prefix_caching=True)
    assert bm.allocate_slots(0, 3, tokens=lambda a, b: tokens[a:b]) == []
    assert bm.find_cached_prefix(lambda a, b: tokens[a:b], 5) == []
    assert bm.allocate_slots(0, 4, tokens=lambda a, b: tokens[a:b]) == []  # fills block 1 in place
    assert [b.block_id for b in bm.find_cached_prefix(lambda a, b: tokens[a:b], 5)] == bm.block_table(0)
    bm.allocate_slots(0, 6, tokens=lambda a, b: tokens[a:b])
    bm.fork(0, 1)
    assert bm.allocate_slots(1, 6) == []  # nothing new written: no copy
    [(src, dst)] = bm.allocate_slots(1, 7)  # writes into the shared, partly full last block
    assert src == bm.block_table(0)[-1] and dst == bm.block_table(1)[-1] != src
    assert bm.allocate_slots(0, 7) == []  # the parent now holds its last block alone
    bm.check_invariants()


def test_step_features_raw_and_bucketed():
    from experiments.simulator.step_time_model import step_features
    from paged_jax.core.scheduler_output import ScheduledChunk, SchedulerOutput

    def chunk(start, n):
        return ScheduledChunk(seq_id=start, token_ids=(5,) * n, start_position=start, num_kept_blocks=0,
                              new_block_ids=(1,), sample=True)
    decode = SchedulerOutput((chunk(7, 1), chunk(20, 1), chunk(3, 1)))
    mixed = SchedulerOutput((chunk(0, 10), chunk(30, 1)))
    # context: each row attends to start + n tokens: 8 + 21 + 4; 10 + 31
    assert step_features(decode) == (3, 3, 33)
    assert step_features(mixed) == (11, 2, 41)
    # padded (batch_inputs.batch_shape): a pure decode step runs the smallest seq bucket >= 3
    # (4) and token bucket >= 4 (8); a step with a prefill chunk runs the largest seq bucket
    # (8) and the smallest token bucket >= max(11, 8) (16)
    buckets = ((2, 4, 8), (8, 16, 32))
    assert step_features(decode, *buckets) == (8, 4, 33)
    assert step_features(mixed, *buckets) == (16, 8, 41)


def test_a_bucketed_model_charges_the_padded_shape():
    # TINY pads every step to 4 rows x 32 tokens: 3.2 s per step at 0.1 s per token
    model = StepTimeModel(intercept_s=0.0, per_token_s=0.1, per_seq_s=0.0, per_context_token_s=0.0, bucketed=True)
    sim = Simulator([Request((5, 6, 7), 2, 0.0)], EngineConfig(**TINY, num_blocks=64), model,
                    configs.get_config("tiny_llama"))
    sim.run()
    assert [sim.times[0].first_token, sim.times[0].finish] == pytest.approx([3.2, 6.4])


def test_paged_gains_more_over_the_oracle_when_output_lengths_spread():
    """experiments/batching_vs_spread.py's claim in small: paged batches more than an
    oracle reservation, and more so the more output lengths spread (the fluid ratio's
    trend), on the same means and budget."""
    config = {"block_size": 4, "max_model_len": 256, "max_num_seqs": 64, "max_num_batched_tokens": 64,
              "attention_backend": "reference", "enable_prefix_caching": False, "num_blocks": 129}
    ratios, fluid = {}, {}
    for sigma in (0.3, 1.2):
        trace = make_trace("sharegpt", 300, seed=4, scale=0.25, max_model_len=256, vocab_size=256, sigma=sigma)
        batched = {}
        for allocator in ("paged", "contiguous-oracle"):
            sim = Simulator(trace, EngineConfig(kv_allocator=allocator, **config), STEP_MODEL,
                            configs.get_config("tiny_llama"))
            batched[allocator] = sim.run()["saturated_mean_batched_seqs"]
        ratios[sigma] = batched["paged"] / batched["contiguous-oracle"]
        fluid[sigma] = fluid_ratio([len(r.prompt_token_ids) for r in trace], [r.max_tokens for r in trace])
    assert 1 < ratios[0.3] < ratios[1.2], ratios
    assert fluid[0.3] < fluid[1.2] < 2, fluid


def test_replay_in_virtual_time_equals_the_simulator():
    """serving_sweep --simulate drives the simulated engine with experiments/benchmarks/replay.py
    instead of Simulator.run: both must serve a trace identically (same arrivals, first
    tokens and finishes on the virtual clock)."""
    from experiments.benchmarks.replay import replay
    from experiments.simulator.simulator import simulated_serving
    trace = make_trace("sharegpt", 60, seed=5, scale=0.1, max_model_len=64, vocab_size=256, request_rate=20.0)
    config = EngineConfig(**TINY, num_blocks=25)
    model_config = configs.get_config("tiny_llama")
    sim = Simulator(trace, config, STEP_MODEL, model_config)
    sim.run()
    expected = sorted((t.arrival, t.first_token, t.finish, t.num_output_tokens) for t in sim.times.values())
    make_engine, clock, sleep = simulated_serving(model_config, STEP_MODEL)
    clock.now = 123.0  # the replay measures from its own start
    records = replay(make_engine(config), trace, lambda r: SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                                                         temperature=0.0), clock=clock, sleep=sleep)
    got = sorted((r["arrival"], r["first_token"], r["finish"], r["output_tokens"]) for r in records)
    assert len(got) == len(trace)
    assert [x for row in got for x in row] == pytest.approx([x for row in expected for x in row])
    assert sim.engine.stats()["num_preemptions"] > 0  # the budget is tight enough to matter
