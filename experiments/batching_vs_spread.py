"""Batched requests of paged vs contiguous reservations, against the spread of the lengths.

    python -m experiments.batching_vs_spread                       # sigma 0.4 .. 1.6, 5000 ShareGPT-like each
    python -m experiments.batching_vs_spread --sigmas=0.8 --num_requests=500   # quick look

Why: the paper batches 2.2x more requests than Orca (Oracle) on ShareGPT. An oracle
reservation holds a request's final length for its whole life, paged blocks only what
it has so far, so the gain depends on how output lengths spread: at saturation the
running set is weighted by how long each request runs (its output length o), so
memory per running request is E[o (p + o)] / E[o] for the oracle and about
E[o (p + o / 2)] / E[o] for paged (p the prompt). Their quotient, the "fluid" ratio
below, grows with the spread of o towards 2 (and beyond, with the oracle's
fragmentation); our ShareGPT-like traces use one log-normal spread (workloads.SIGMA),
and this script shows what the batching gain is across spreads instead of at that
one value.

Per --sigmas value: a trace with the data set's means and that log-normal sigma, served
by the simulator (experiments/simulate.py: the real scheduler and allocators, no model)
for each --kv_allocator at one KV budget, all requests at t = 0. The record holds per
allocator the mean batched requests over steps with requests waiting (the batch the
budget admits), the plain mean, KV utilization and preemptions; paged / each other
allocator; and the trace's fluid ratio.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags

from paged_jax.config.engine_config import KV_ALLOCATORS

_SIGMAS = flags.DEFINE_list("sigmas", ["0.4", "0.8", "1.2", "1.6"], "Log-normal spreads of the lengths to run.")
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Data set whose mean lengths to use.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 5000, "Requests per trace (all at t = 0).")
_ALLOCATORS = flags.DEFINE_list("kv_allocator", ["paged", "contiguous-oracle", "contiguous-max"],
                                f"KV allocators, among {KV_ALLOCATORS}; the first is the numerator of the ratios.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", None, "KV blocks incl. the null block (default: the engine's "
                                                       "512 MiB budget for --model_config).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "Engine max_model_len (and the traces' cap).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 256, "Sequences per step (high: memory limits batching).")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 512, "Tokens per step.")
_STEP_TIME_MODEL = flags.DEFINE_string("step_time_model", "experiments/results/step_time_model.json",
                                       "Step-time model (times only; batching does not depend on it).")
_MODEL_CONFIG = flags.DEFINE_string("model_config", "smollm2_135m", "configs preset: KV bytes per block.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed (the same for every sigma).")
_OUTPUT = flags.DEFINE_string("output", "batching_vs_spread", "Result name: experiments/results/<output>.json.")


def main(argv):
    del argv
    import configs
    from experiments.reporting.results_io import write_result
    from experiments.simulator.simulator import Simulator, budget_num_blocks
    from experiments.simulator.step_time_model import StepTimeModel
    from experiments.benchmarks.workloads import fluid_ratio, make_trace
    from paged_jax.config.engine_config import EngineConfig
    if set(_ALLOCATORS.value) - set(KV_ALLOCATORS):
        raise app.UsageError(f"--kv_allocator must be among {KV_ALLOCATORS}; got {_ALLOCATORS.value}")
    model_config = configs.get_config(_MODEL_CONFIG.value)
    step_model = StepTimeModel.load(_STEP_TIME_MODEL.value)
    num_blocks = _NUM_BLOCKS.value or budget_num_blocks(model_config, _BLOCK_SIZE.value)
    start = time.perf_counter()
    points = []
    for sigma in (float(s) for s in _SIGMAS.value):
        trace = make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, max_model_len=_MAX_MODEL_LEN.value,
                           vocab_size=model_config.vocab_size, sigma=sigma)
        prompt_lens = [len(r.prompt_token_ids) for r in trace]
        output_lens = [r.max_tokens for r in trace]
        rows = []
        for allocator in _ALLOCATORS.value:
            config = EngineConfig(block_size=_BLOCK_SIZE.value, num_blocks=num_blocks, max_model_len=_MAX_MODEL_LEN.value,
                                  max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=_MAX_BATCHED.value,
                                  enable_prefix_caching=False, kv_allocator=allocator, attention_backend="reference",
                                  paper_metrics=True)
            stats = Simulator(trace, config, step_model, model_config).run()
            rows.append({"kv_allocator": allocator,
                         "saturated_mean_batched_seqs": stats["saturated_mean_batched_seqs"],
                         "num_saturated_steps": stats["num_saturated_steps"],
                         "mean_batched_seqs": stats["mean_batched_seqs"], "kv_utilization": stats["kv_utilization"],
                         "num_preemptions": stats["num_preemptions"], "num_steps": stats["num_steps"],
                         "wall_seconds": round(stats["wall_seconds"], 2)})
            print(f"sigma {sigma}: {allocator:>17} batched while waiting {stats['saturated_mean_batched_seqs']:.1f} "
                  f"(mean {stats['mean_batched_seqs']:.1f}), utilization {stats['kv_utilization']:.3f}, "
                  f"{stats['num_preemptions']} preemptions, {stats['wall_seconds']:.0f} s", flush=True)
        first = rows[0]
        ratios = {f"{first['kv_allocator']}_over_{r['kv_allocator']}":
                  round(first["saturated_mean_batched_seqs"] / r["saturated_mean_batched_seqs"], 3) for r in rows[1:]}
        points.append({"sigma": sigma, "mean_prompt_tokens": float(np.mean(prompt_lens)),
                       "mean_output_tokens": float(np.mean(output_lens)),
                       "output_cv": float(np.std(output_lens) / np.mean(output_lens)),
                       "fluid_ratio": round(fluid_ratio(prompt_lens, output_lens), 3), "allocators": rows,
                       "saturated_batched_ratios": ratios})
    figures = {"model_config": _MODEL_CONFIG.value, "workload": _WORKLOAD.value, "num_blocks": num_blocks,
               "points": points, "wall_seconds_total": round(time.perf_counter() - start, 1),
               "load_average_end": os.getloadavg()}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    names = [f"{_ALLOCATORS.value[0]}/{a}" for a in _ALLOCATORS.value[1:]]
    print(f"\n{'sigma':>5} {'out cv':>6} {'fluid':>6} " + " ".join(f"{n:>28}" for n in names))
    for p in points:
        print(f"{p['sigma']:>5.2f} {p['output_cv']:>6.2f} {p['fluid_ratio']:>6.2f} "
              + " ".join(f"{v:>28.2f}" for v in p["saturated_batched_ratios"].values()))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
