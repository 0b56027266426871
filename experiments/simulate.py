"""Simulate serving a trace: the real scheduler and KV allocator, no model, a virtual clock.

    python -m experiments.simulate                                   # 100,000 Alpaca-like requests
    python -m experiments.simulate --workload=sharegpt --kv_allocator=paged --block_size=8,16,32 --request_rate=2

Why: comparing allocation policies and block sizes on the paper's scale (hundreds of
thousands of requests, long traces at many request rates) on real hardware takes days;
the decisions that differ between policies (what is admitted, batched, preempted) are
all made by host-side Python that needs no model. So the simulator builds a real
LLMEngine (scheduler, BlockManager or ContiguousAllocator, stop checks, outputs, stats)
through its injection points (experiments/simulator/simulator.py): a runner that samples a fixed token per scheduled row
instead of running a model and a virtual clock that each step advances by a step-time
model fitted to the real engine (steps of plain requests are applied directly, at the cost
of their events, with the same effect: experiments/simulator/fast_forward.py) (experiments/simulator/step_time_model.py, fitted by
experiments/calibrate_step_time.py). Requests join at their virtual arrival times, run
with ignore_eos and the trace's max_tokens, so their lengths are the trace's. Because it
is the engine's own code, the schedule is the real engine's step for step
(tests/experiments/test_simulate.py checks it against the engine with a model); only time is modelled.

Per (allocator, block size) the record holds the engine's stats (kv_utilization, waste
split, mean / max batched sequences, preemptions, steps), per-request latencies on the
virtual clock (normalized latency = (finish - arrival) / output tokens, mean; TTFT and
TPOT p50 / p90 / p99), throughput in requests/s and output tokens/s of virtual time,
and the wall time the simulation itself took.
"""

from __future__ import annotations

import math
import os
import time

from experiments.simulator.simulator import Simulator, budget_num_blocks
from experiments.simulator.step_time_model import StepTimeModel
from paged_jax.config.engine_config import EngineConfig


# flags are defined in main's module only when run, so importing this defines none
def _define_flags():
    from absl import flags

    from paged_jax.config.engine_config import KV_ALLOCATORS, PREEMPTION_MODES
    flags.DEFINE_enum("workload", "alpaca", ["sharegpt", "alpaca"], "Length statistics of the trace (100,000 "
                      "ShareGPT-like requests simulate in ~1 min on one core, paged).")
    flags.DEFINE_integer("num_requests", 100_000, "Requests in the trace.")
    flags.DEFINE_float("scale", 1.0, "Length scale of the trace (1.0: the data set's means).")
    flags.DEFINE_float("request_rate", None, "Poisson arrivals per second of virtual time; unset or inf: all at t = 0.")
    flags.DEFINE_list("kv_allocator", ["paged", "contiguous-max"], f"KV allocators to simulate, among {KV_ALLOCATORS}.")
    flags.DEFINE_list("block_size", ["16"], "Block sizes to simulate (each with each allocator).")
    flags.DEFINE_integer("num_blocks", None, "KV blocks incl. the null block (default: from the byte budget).")
    flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV budget in bytes for --model_config's KV layout "
                                                        "(default: the engine's, 512 MiB); the same for every block size.")
    flags.DEFINE_integer("max_model_len", 2048, "Engine max_model_len (and the trace's length cap).")
    flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step (default: what the step-time model was fitted on).")
    flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step (default: as fitted).")
    flags.DEFINE_enum("preemption_mode", "recompute", list(PREEMPTION_MODES), "Preemption of the paged allocator "
                                                                             "(contiguous ones recompute).")
    flags.DEFINE_bool("enable_prefix_caching", False, "Prefix caching for the paged allocator (a recomputed "
                                                      "request then finds its own freed blocks).")
    flags.DEFINE_string("step_time_model", "experiments/results/step_time_model.json",
                        "JSON step-time model: calibrate_step_time.py's record, or a bare dict of coefficients.")
    flags.DEFINE_string("model_config", "smollm2_135m", "configs preset: vocabulary and KV bytes per block.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_string("output", "simulate", "Result name: experiments/results/<output>.json.")


def python_loop_seconds(n: int = 5_000_000) -> float:
    """Seconds this machine's Python takes for a fixed loop of n additions (best of 3):
    the simulator's wall time is host Python, so records carry this figure, and wall
    times from different machines (which differ 2x for the same code) can be compared."""
    best = math.inf
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(n):
            total += i
        best = min(best, time.perf_counter() - start)
    return round(best, 3)


def _row(allocator: str, block_size: int, config: EngineConfig, figures: dict) -> dict:
    keys = ("kv_utilization", "waste_internal_slots", "waste_reservation_slots", "waste_external_slots",
            "mean_batched_seqs", "max_batched_seqs", "mean_batched_tokens", "num_preemptions", "num_steps",
            "num_requests", "output_tokens", "virtual_seconds", "requests_per_s", "output_tokens_per_s",
            "mean_normalized_latency_s", "ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "tpot_s_p50", "tpot_s_p90",
            "tpot_s_p99", "host_seconds_per_step", "wall_seconds", "cpu_seconds")
    row = {"kv_allocator": allocator, "block_size": block_size, "num_blocks": config.num_blocks}
    for key in keys:
        value = figures.get(key)
        row[key] = round(value, 6) if isinstance(value, float) else value
    return row


def main(argv):
    del argv
    from absl import flags
    from tqdm.auto import tqdm

    import configs
    from experiments.reporting.results_io import write_result
    from experiments.benchmarks.workloads import make_trace, trace_means
    f = flags.FLAGS
    total_start, load_average_start = time.perf_counter(), os.getloadavg()
    model_config = configs.get_config(f.model_config)
    step_model = StepTimeModel.load(f.step_time_model)
    rate = None if f.request_rate is None or math.isinf(f.request_rate) else f.request_rate
    start = time.perf_counter()
    trace = make_trace(f.workload, f.num_requests, seed=f.seed, scale=f.scale, max_model_len=f.max_model_len,
                       vocab_size=model_config.vocab_size, request_rate=rate)
    trace_seconds = time.perf_counter() - start
    means = trace_means(trace)
    print(f"{len(trace)} {f.workload}-like requests (scale {f.scale}, "
          f"{'all at t=0' if rate is None else f'{rate}/s'}): mean prompt {means['mean_prompt_tokens']:.1f}, mean "
          f"output {means['mean_output_tokens']:.1f} tokens; trace made in {trace_seconds:.1f} s")
    rows = []
    for block_size in (int(b) for b in f.block_size):
        for allocator in f.kv_allocator:
            num_blocks = f.num_blocks or budget_num_blocks(model_config, block_size, f.kv_cache_memory_bytes)
            config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_model_len=f.max_model_len,
                                  max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
                                  preemption_mode=f.preemption_mode if allocator == "paged" else "recompute",
                                  enable_prefix_caching=f.enable_prefix_caching, kv_allocator=allocator,
                                  attention_backend="reference",  # unused: no model runs
                                  paper_metrics=True)
            sim = Simulator(trace, config, step_model, model_config)
            with tqdm(total=len(trace), desc=f"{allocator} block {block_size}", mininterval=1.0) as bar:
                figures = sim.run(progress=bar.update)
            rows.append(_row(allocator, block_size, config, figures))
            del sim
    total_seconds = time.perf_counter() - total_start
    figures = {"model_config": f.model_config, "step_time_model": step_model.to_dict(),
               "workload": f.workload, "request_rate": rate, **means, "trace_seconds": round(trace_seconds, 2),
               "runs": rows, "wall_seconds_total": round(total_seconds, 2),
               "load_average_start": load_average_start, "load_average_end": os.getloadavg(),
               "python_loop_seconds": python_loop_seconds(),
               "note": "wall_seconds: the simulation itself (one allocator and block size); virtual_seconds and "
                       "every latency / throughput: the virtual clock of the step-time model"}
    flag_values = {name: f[name].value for name in (
        "workload", "num_requests", "scale", "request_rate", "kv_allocator", "block_size", "num_blocks",
        "kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "preemption_mode",
        "enable_prefix_caching", "step_time_model", "model_config", "seed", "output")}
    print("wrote", write_result(f.output, flags=flag_values, figures=figures, seed=f.seed))
    _print_table(rows)
    print(f"total wall time {total_seconds:.1f} s")


def _print_table(rows) -> None:
    print(f"\n{'allocator':>17} {'block':>5} {'util':>6} {'intern.':>8} {'reserv.':>8} {'extern.':>8} {'batch':>6} "
          f"{'preempt':>7} {'steps':>8} {'req/s':>7} {'tok/s':>8} {'norm.lat':>8} {'ttft50':>8} {'tpot50':>7} "
          f"{'tpot99':>7} {'wall s':>7} {'cpu s':>7}")
    for r in rows:
        print(f"{r['kv_allocator']:>17} {r['block_size']:>5} {r['kv_utilization']:>6.3f} "
              f"{r['waste_internal_slots']:>8.1f} {r['waste_reservation_slots']:>8.1f} "
              f"{r['waste_external_slots']:>8.1f} {r['mean_batched_seqs']:>6.2f} {r['num_preemptions']:>7} "
              f"{r['num_steps']:>8} {r['requests_per_s']:>7.3f} {r['output_tokens_per_s']:>8.1f} "
              f"{r['mean_normalized_latency_s']:>8.3f} {r['ttft_s_p50']:>8.2f} {r['tpot_s_p50']:>7.3f} "
              f"{r['tpot_s_p99']:>7.3f} {r['wall_seconds']:>7.1f} {r['cpu_seconds']:>7.1f}")


if __name__ == "__main__":
    from absl import app
    from absl import flags as absl_flags
    _define_flags()
    absl_flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
