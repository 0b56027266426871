"""Normalized latency against request rate, per KV allocator (the paper's Fig. 12).

    python -m experiments.serving_sweep --num_requests=40 --output=serving_sweep_kv2   # the committed run
    python -m experiments.serving_sweep --model=tiny_llama --request_rates=2,8 --num_requests=16   # fast
    python -m experiments.serving_sweep --simulate --num_requests=2000 --output=serving_sweep_simulated

Why: offline throughput hides what a serving system is judged on, the request rate it
sustains before latency runs away. For each allocator (`--kv_allocator`, same model, KV
budget and scheduler) and each rate, a fresh seeded trace with Poisson arrivals is
replayed in real time against an in-process LLMEngine (no HTTP: this measures the
engine, `benchmark_serving` measures the server): requests are added when their arrival
time has passed, the engine steps while it has work, and each request's arrival, first
token and finish times come from the engine's own metrics. Per point: normalized latency
(end-to-end latency / output tokens, mean over requests, the paper's y axis), TTFT and
TPOT percentiles, output tokens/s and mean batched requests.

With --simulate the same replay runs on the simulator's engine (experiments/simulate.py:
the real scheduler and allocators, no model, a virtual clock advanced by the fitted
step-time model): a point of thousands of requests takes seconds, so the traces are long
enough for queues to build up past an allocator's capacity, which a real-time run of a
few dozen requests on this CPU cannot show (its latency is bounded by the short trace).

The sustained rate of an allocator is the highest rate whose mean normalized latency
stays within `--slo_factor` times the lowest normalized latency any allocator reached
(one yardstick for all); None if even the lowest rate misses it.
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments.benchmarks.replay import replay, summarize, sustained_rates
from paged_jax.config.engine_config import KV_ALLOCATORS as ALLOCATORS

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset (random "
                                                      "weights: fast, not for claims).")
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Length statistics of the trace.")
_SCALE = flags.DEFINE_float("scale", 0.1, "Length scale of the trace (1.0: the data set's means).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 60, "Requests per (allocator, rate) point.")
_RATES = flags.DEFINE_list("request_rates", ["1", "2", "4", "8"], "Poisson arrival rates (requests/s).")
_ALLOCATORS = flags.DEFINE_list("kv_allocator", list(ALLOCATORS), "KV allocators to run, in order.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block (every allocator).")
_KV_SEQS = flags.DEFINE_integer("kv_seqs", 2, "KV budget in max_model_len-long sequences (unless --num_blocks).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", None, "KV blocks incl. the null block (overrides --kv_seqs).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "Engine max_model_len (and the trace's cap).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 128, "Tokens per step.")
_SLO_FACTOR = flags.DEFINE_float("slo_factor", 2.0, "Sustained: mean normalized latency <= this x the best seen.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed (the same traces for every allocator).")
_SIMULATE = flags.DEFINE_bool("simulate", False, "Replay on the simulator (virtual clock, --step_time_model) instead "
                                                 "of running --model.")
_STEP_TIME_MODEL = flags.DEFINE_string("step_time_model", "experiments/results/step_time_model.json",
                                       "With --simulate: the step-time model (experiments/calibrate_step_time.py).")
_MODEL_CONFIG = flags.DEFINE_string("model_config", "smollm2_135m", "With --simulate: configs preset for the "
                                                                    "vocabulary and KV layout.")
_OUTPUT = flags.DEFINE_string("output", "serving_sweep", "Result name: experiments/results/<output>.json.")


def main(argv):
    del argv
    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from experiments.benchmarks.workloads import make_trace
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.entrypoints.allocators import make_allocator
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.core.sampling_params import SamplingParams
    if set(_ALLOCATORS.value) - set(ALLOCATORS):
        raise app.UsageError(f"--kv_allocator must be among {ALLOCATORS}; got {_ALLOCATORS.value}")
    rates = sorted(float(r) for r in _RATES.value)
    if _SIMULATE.value:
        model_config, make_engine, clock, sleep, source = _simulated()
    else:
        enable_compilation_cache()
        model = load_for_benchmark(_MODEL.value, _MAX_MODEL_LEN.value)
        # the replay reads finished requests only: no per-step outputs for running ones
        make_engine = lambda config: LLMEngine(model, config, final_outputs_only=True, allocator_factory=make_allocator)
        clock, sleep, source = time.monotonic, time.sleep, model.source
        model_config = model.config
    max_len = _MAX_MODEL_LEN.value
    settings = {"block_size": _BLOCK_SIZE.value, "max_model_len": max_len, "max_num_seqs": _MAX_NUM_SEQS.value,
                "max_num_batched_tokens": _MAX_BATCHED.value, "enable_prefix_caching": False,
                "num_blocks": _NUM_BLOCKS.value or _KV_SEQS.value * -(-max_len // _BLOCK_SIZE.value) + 1}
    params_for = lambda r: SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
    traces = {rate: make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value,
                               max_model_len=max_len, vocab_size=model_config.vocab_size, request_rate=rate)
              for rate in rates}
    curves = {}
    for allocator in _ALLOCATORS.value:
        engine = make_engine(EngineConfig(kv_allocator=allocator, **settings))
        curves[allocator] = []
        for rate in rates:
            steps, batched = engine.stats_tracker.num_steps, engine.stats_tracker.num_batched_seqs
            records = replay(engine, traces[rate], params_for, clock=clock, sleep=sleep)
            point = {"request_rate": rate, **summarize(records),
                     "mean_batched_seqs": (engine.stats_tracker.num_batched_seqs - batched)
                     / max(1, engine.stats_tracker.num_steps - steps)}
            curves[allocator].append(point)
            print(f"{allocator:>17} rate {rate:6.2f}/s: normalized latency {point['normalized_latency_s_per_token']:.3f}"
                  f" s/token, TTFT p50 {point['ttft_p50_s']:.2f} s, {point['output_tokens_per_s']:.1f} tok/s, "
                  f"batch {point['mean_batched_seqs']:.1f}", flush=True)
        assert engine.stats()["num_compilations_after_warm_up"] == 0
        del engine
    sustained = sustained_rates(curves, _SLO_FACTOR.value)
    figures = {"model": source, "simulated": _SIMULATE.value, "workload": _WORKLOAD.value, "scale": _SCALE.value,
               "engine_settings": settings,
               "allocators": [{"kv_allocator": a, "points": p} for a, p in curves.items()],
               "sustained_rate": sustained, "slo_factor": _SLO_FACTOR.value}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    print("sustained rate (requests/s):", sustained)


def _simulated():
    """(model config, engine factory, clock, sleep, source label) for --simulate."""
    import configs
    from experiments.simulator.simulator import simulated_serving
    from experiments.simulator.step_time_model import StepTimeModel
    model_config = configs.get_config(_MODEL_CONFIG.value)
    make_engine, clock, sleep = simulated_serving(model_config, StepTimeModel.load(_STEP_TIME_MODEL.value))
    return model_config, make_engine, clock, sleep, f"the {_MODEL_CONFIG.value} config (no weights)"


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
