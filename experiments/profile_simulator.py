"""Where the simulator's wall time goes: one simulated engine under cProfile.

    python -m experiments.profile_simulator                       # 10,000 ShareGPT-like requests
    python -m experiments.profile_simulator --num_requests=100000 --noprofile   # just the wall time

Why: the simulator's speed is host Python per step, and which part dominates (real
engine steps vs fast-forwarded runs; scheduling, block tables, outputs, stats) decides
what to make faster. This runs `experiments.simulate`'s default one-engine setup
(paged, block 16, 32 sequences, 256 tokens, all requests at t = 0) and records the
split of steps (real `engine.step()` calls vs fast-forwarded steps), why each
fast-forward run ended, and the functions with the most own and cumulative time.
cProfile roughly doubles the wall time; `--noprofile` measures it without.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from experiments.simulate import _row
from experiments.simulator.simulator import Simulator, budget_num_blocks
from experiments.simulator.step_time_model import StepTimeModel
from paged_jax.config.engine_config import EngineConfig


def _define_flags():
    from absl import flags

    flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Length statistics of the trace.")
    flags.DEFINE_integer("num_requests", 10_000, "Requests in the trace (all at t = 0).")
    flags.DEFINE_integer("block_size", 16, "KV block size.")
    flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step.")
    flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step.")
    flags.DEFINE_bool("profile", True, "Run under cProfile (about 2x slower); --noprofile: wall time only.")
    flags.DEFINE_integer("top", 25, "Functions to record per ranking.")
    flags.DEFINE_string("step_time_model", "experiments/results/step_time_model.json", "Fitted step-time model.")
    flags.DEFINE_string("output", "profile_simulator", "Result name: experiments/results/<output>.json.")


def _top(stats: pstats.Stats, key: str, n: int) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:
        calls, _, own, cumulative, _ = stats.stats[func]
        path, line, name = func
        rows.append({"function": f"{path.split('paged_jax/')[-1]}:{line}({name})", "calls": calls,
                     "own_s": round(own, 3), "cumulative_s": round(cumulative, 3)})
    return rows


def main(argv):
    del argv
    from absl import flags

    import configs
    from experiments.benchmarks.workloads import make_trace
    from experiments.reporting.results_io import write_result
    f = flags.FLAGS
    model_config = configs.get_config("smollm2_135m")
    step_model = StepTimeModel.load(f.step_time_model)
    trace = make_trace(f.workload, f.num_requests, seed=0, max_model_len=2048, vocab_size=model_config.vocab_size)
    num_blocks = budget_num_blocks(model_config, f.block_size)
    config = EngineConfig(block_size=f.block_size, num_blocks=num_blocks, max_model_len=2048,
                          max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
                          preemption_mode="recompute", enable_prefix_caching=False, attention_backend="reference")
    sim = Simulator(trace, config, step_model, model_config)
    profiler = cProfile.Profile() if f.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    figures = sim.run()
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    ff = sim.fast_forward
    real_steps = figures["num_steps"] - ff.num_steps - ff.num_lean_steps
    result = {"wall_seconds": round(wall, 2), "profiled": f.profile, "num_requests": f.num_requests,
              "num_steps": figures["num_steps"], "real_steps": real_steps, "fast_forwarded_steps": ff.num_steps,
              "prefill_steps": ff.num_prefill_steps, "preempting_steps": ff.num_preempting_steps,
              "admitting_steps": ff.num_admitting_steps, "finishing_steps": ff.num_finishing_steps,
              "lean_steps": ff.num_lean_steps,
              "fast_forward_runs": ff.num_runs, "run_ends": dict(sorted(ff.run_ends.items())),
              "num_preemptions": figures["num_preemptions"],
              "us_per_step": round(wall / figures["num_steps"] * 1e6, 2),
              "run": _row("paged", f.block_size, config, figures)}
    if profiler is not None:
        stats = pstats.Stats(profiler, stream=io.StringIO())
        result["top_own"] = _top(stats, "tottime", f.top)
        result["top_cumulative"] = _top(stats, "cumulative", f.top)
    flag_values = {name: f[name].value for name in ("workload", "num_requests", "block_size", "max_num_seqs",
                                                    "max_num_batched_tokens", "profile", "step_time_model")}
    print("wrote", write_result(f.output, flags=flag_values, figures=result, seed=0))
    print(f"{wall:.1f} s wall for {figures['num_steps']} steps ({real_steps} real, {ff.num_lean_steps} through "
          f"schedule() alone, {ff.num_steps} fast-forwarded: {ff.num_prefill_steps} with a prefill, "
          f"{ff.num_preempting_steps} preempting, {ff.num_admitting_steps} admitting, {ff.num_finishing_steps} "
          f"finishing), {figures['num_preemptions']} preemptions")
    print("fast-forward runs ended by:", result["run_ends"])
    for row in result.get("top_own", [])[:15]:
        print(f"{row['own_s']:>8.2f} {row['cumulative_s']:>8.2f} {row['calls']:>9} {row['function']}")


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
