"""Simulate a fleet of replicas behind a router: which routing policy, on which workload.

    python -m experiments.simulate_fleet                # 100,000 requests, 8 replicas, 3 policies
    python -m experiments.simulate_fleet --num_requests=2000 --num_replicas=4 --policy=round-robin,prefix-aware

Why: whether prefix-aware routing pays (cache hits, time to first token) and what it
costs in balance depends on the workload, the KV budget per replica and the load;
sweeping that on real replicas takes hours, and the decisions that matter (which
replica gets a request, what its scheduler and prefix cache then do) are host-side
Python that needs no model. Each replica is the simulator's engine (the real scheduler,
block manager and prefix cache, a virtual clock advanced by the step-time model fitted
to the real engine); experiments/simulator/fleet.py runs them in one event loop and
experiments/simulator/routing.py holds the policies (prefix-aware is sgl-router's
cache-aware rule). The default workload is `system-prompts`: --num_prefixes distinct
--prefix_len-token system prompts, each request after one of them, then an Alpaca-like
question (experiments/benchmarks/workloads.py), Poisson arrivals at --request_rate.

Per policy the record holds the fleet's prefix-cache hit rate (hit / looked-up tokens),
TTFT and TPOT p50 / p90 / p99 and normalized latency on the virtual clock, throughput,
requests per replica and the largest deviation from their mean, preemptions, and the
wall time the simulation took. `python -m experiments.plots --only=fleet_routing` draws
the record.
"""

from __future__ import annotations

import os
import time

from experiments.simulator.fleet import FleetSimulator
from experiments.simulator.routing import POLICIES, make_router
from experiments.simulator.simulator import budget_num_blocks
from experiments.simulator.step_time_model import StepTimeModel
from paged_jax.config.engine_config import EngineConfig

_ROW_KEYS = ("prefix_cache_hit_rate", "ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "tpot_s_p50", "tpot_s_p90",
             "tpot_s_p99", "mean_normalized_latency_s", "requests_per_s", "output_tokens_per_s", "virtual_seconds",
             "num_requests", "output_tokens", "requests_per_replica", "max_load_deviation", "num_steps",
             "num_preemptions", "num_prefix_cache_evictions", "mean_batched_seqs", "router", "wall_seconds",
             "cpu_seconds")


# flags are defined in main's module only when run, so importing this defines none
def _define_flags():
    from absl import flags

    from experiments.benchmarks.workloads import WORKLOADS
    flags.DEFINE_list("policy", list(POLICIES), f"Routing policies to compare, among {list(POLICIES)}.")
    flags.DEFINE_integer("num_replicas", 8, "Replicas behind the router (each a simulated engine).")
    flags.DEFINE_enum("workload", "system-prompts", list(WORKLOADS), "Trace (experiments/benchmarks/workloads.py).")
    flags.DEFINE_integer("num_requests", 100_000, "Requests in the trace.")
    flags.DEFINE_float("request_rate", 4.0, "Poisson arrivals per second over the whole fleet (virtual time; "
                                            "4/s: round-robin stays below saturation on the defaults).")
    flags.DEFINE_integer("num_prefixes", 16, "system-prompts: distinct system prompts.")
    flags.DEFINE_integer("prefix_len", 1024, "system-prompts / shared-prefix: tokens per prefix.")
    flags.DEFINE_float("scale", 1.0, "Length scale of the questions / prompts (1.0: the data set's means).")
    flags.DEFINE_integer("block_size", 16, "KV block size of every replica.")
    flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV budget per replica in bytes for --model_config "
                                                        "(default: the engine's, 512 MiB).")
    flags.DEFINE_integer("max_model_len", 2048, "Engine max_model_len (and the trace's length cap).")
    flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step per replica (as the step-time model was fitted).")
    flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step per replica (as fitted).")
    flags.DEFINE_bool("enable_prefix_caching", True, "Prefix caching on every replica.")
    flags.DEFINE_float("cache_threshold", 0.5, "prefix-aware: route by cache when the matched prefix is more than "
                                               "this fraction of the prompt (sgl-router's default).")
    flags.DEFINE_integer("balance_abs", 32, "prefix-aware: imbalance in requests in flight beyond which the "
                                            "least-loaded replica is chosen (sgl-router's default).")
    flags.DEFINE_string("step_time_model", "experiments/results/step_time_model.json",
                        "JSON step-time model: calibrate_step_time.py's record, or a bare dict of coefficients.")
    flags.DEFINE_string("model_config", "smollm2_135m", "configs preset: vocabulary and KV bytes per block.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_string("output", "simulate_fleet", "Result name: experiments/results/<output>.json.")


def main(argv):
    del argv
    from absl import flags
    from tqdm.auto import tqdm

    import configs
    from experiments.benchmarks.workloads import make_trace, trace_means
    from experiments.reporting.results_io import write_result
    f = flags.FLAGS
    total_start, load_average_start = time.perf_counter(), os.getloadavg()
    model_config = configs.get_config(f.model_config)
    step_model = StepTimeModel.load(f.step_time_model)
    start = time.perf_counter()
    trace = make_trace(f.workload, f.num_requests, seed=f.seed, scale=f.scale, max_model_len=f.max_model_len,
                       vocab_size=model_config.vocab_size, request_rate=f.request_rate, prefix_len=f.prefix_len,
                       num_prefixes=f.num_prefixes)
    trace_seconds = time.perf_counter() - start
    means = trace_means(trace)
    print(f"{len(trace)} {f.workload}-like requests at {f.request_rate}/s over {f.num_replicas} replicas: mean prompt "
          f"{means['mean_prompt_tokens']:.1f}, mean output {means['mean_output_tokens']:.1f} tokens; trace made "
          f"in {trace_seconds:.1f} s")
    num_blocks = budget_num_blocks(model_config, f.block_size, f.kv_cache_memory_bytes)
    config = EngineConfig(block_size=f.block_size, num_blocks=num_blocks, max_model_len=f.max_model_len,
                          max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
                          enable_prefix_caching=f.enable_prefix_caching, attention_backend="reference")
    rows = []
    for policy in f.policy:
        options = ({"cache_threshold": f.cache_threshold, "balance_abs": f.balance_abs}
                   if policy == "prefix-aware" else {})
        router = make_router(policy, f.num_replicas, f.block_size, **options)
        fleet = FleetSimulator(trace, config, step_model, model_config, num_replicas=f.num_replicas, router=router)
        with tqdm(total=len(trace), desc=policy, mininterval=1.0) as bar:
            figures = fleet.run(progress=bar.update)
        rows.append({"policy": policy, **{k: _rounded(figures.get(k)) for k in _ROW_KEYS}})
        del fleet
    total_seconds = time.perf_counter() - total_start
    figures = {"model_config": f.model_config, "step_time_model": step_model.to_dict(), "workload": f.workload,
               "num_blocks_per_replica": num_blocks, **means,
               "trace_seconds": round(trace_seconds, 2), "runs": rows, "wall_seconds_total": round(total_seconds, 2),
               "load_average_start": load_average_start, "load_average_end": os.getloadavg(),
               "note": "wall_seconds: the simulation of one policy; every latency / throughput: the virtual clock "
                       "of the step-time model; hit rate: prefix-cache hit tokens / looked-up tokens over the fleet"}
    flag_values = {name: f[name].value for name in (
        "policy", "num_replicas", "workload", "num_requests", "request_rate", "num_prefixes", "prefix_len", "scale",
        "block_size", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "enable_prefix_caching", "cache_threshold", "balance_abs", "step_time_model", "model_config", "seed",
        "output")}
    print("wrote", write_result(f.output, flags=flag_values, figures=figures, seed=f.seed))
    _print_table(rows)
    print(f"total wall time {total_seconds:.1f} s")


def _rounded(value):
    return round(value, 6) if isinstance(value, float) else value


def _print_table(rows) -> None:
    print(f"\n{'policy':>13} {'hit rate':>8} {'ttft50':>8} {'ttft90':>8} {'tpot50':>7} {'tok/s':>8} "
          f"{'per replica (min-max)':>22} {'dev':>5} {'preempt':>8} {'wall s':>7}")
    for r in rows:
        counts = r["requests_per_replica"]
        print(f"{r['policy']:>13} {r['prefix_cache_hit_rate']:>8.3f} {r['ttft_s_p50']:>8.3f} {r['ttft_s_p90']:>8.3f} "
              f"{r['tpot_s_p50']:>7.3f} {r['output_tokens_per_s']:>8.1f} {f'{min(counts)}-{max(counts)}':>22} "
              f"{r['max_load_deviation']:>5.2f} {r['num_preemptions']:>8} {r['wall_seconds']:>7.1f}")


if __name__ == "__main__":
    from absl import app
    from absl import flags as absl_flags
    _define_flags()
    absl_flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
