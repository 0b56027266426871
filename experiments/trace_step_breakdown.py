"""Where our engine's time goes on the vLLM-peer trace, by step kind, per token budget.

    python -m experiments.trace_step_breakdown                                  # bf16, budgets 256 / 1024 / 2048
    python -m experiments.trace_step_breakdown --dtype=float32 --output=trace_step_breakdown_f32

Why: experiments/peer_vllm.py gives one throughput per run; choosing the engine's settings
(the token budget per step above all) and seeing what to speed up next needs the time of
each kind of step. The same trace as peer_vllm (64 ShareGPT-like requests, outputs capped
at --max_output_tokens, greedy, EOS ignored, all at t=0) runs through `LLM.generate` once
per --max_num_batched_tokens value; every device step is timed at the runner
(`ModelRunner.run_batch`, inputs already prepared) and grouped by padded shape
(rows, tokens) and kind: "decode" (one token per row) or "mixed" (a prefill chunk in it),
with the minor page faults per step (fresh pages the step touched: ~3,300 per 64-row
decode step while the sampler's buffers were part of the step, none after).
The engine is built and warmed up before its run; its setup time (compiles) is reported
apart.
"""

from __future__ import annotations

import collections
import dataclasses
import resource
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Registered model name.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "EngineConfig.dtype.")
_BUDGETS = flags.DEFINE_list("max_num_batched_tokens", ["256", "1024", "2048"], "Token budgets per step to run.")
_ATTENTION = flags.DEFINE_string("attention_backend", "auto", "EngineConfig.attention_backend.")
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"],
                              "experiments/benchmarks/workloads.py trace (peer_vllm's: sharegpt).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests in the trace.")
_MAX_OUTPUT = flags.DEFINE_integer("max_output_tokens", 120, "Cap on each request's output tokens.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "EngineConfig.max_num_seqs.")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 2.0, "KV cache budget, GiB.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace and engine seed.")
_OUTPUT = flags.DEFINE_string("output", "trace_step_breakdown", "Result name: experiments/results/<output>.json.")


def run_budget(loaded, requests, budget: int) -> dict:
    """One engine at this token budget: its setup, wall time, and device time per step kind."""
    import numpy as np

    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.llm import LLM
    start = time.perf_counter()
    llm = LLM(loaded, max_model_len=2048, max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=budget,
              kv_cache_memory_bytes=int(_KV_GIB.value * 2**30), dtype=_DTYPE.value, seed=_SEED.value,
              attention_backend=_ATTENTION.value)
    setup_s = time.perf_counter() - start
    runner = llm.engine.core.runner
    steps = []
    run_batch = runner.run_batch

    def timed(batch):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        begin = time.perf_counter()
        result = run_batch(batch)
        q_lens = np.diff(batch.query_start_loc)
        steps.append((batch.block_tables.shape[0], batch.token_ids.shape[0], bool((q_lens > 1).any()),
                      time.perf_counter() - begin, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        return result

    runner.run_batch = timed
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                 [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests],
                 use_tqdm=True)
    wall = time.perf_counter() - start
    groups = collections.defaultdict(list)
    for rows, tokens, mixed, seconds, faults in steps:
        groups[(rows, tokens, "mixed" if mixed else "decode")].append((seconds, faults))
    kinds = [{"rows": r, "tokens": t, "kind": k, "steps": len(v), "total_s": round(sum(x for x, _ in v), 2),
              "mean_ms": round(1e3 * sum(x for x, _ in v) / len(v), 1),
              "page_faults_per_step": round(sum(f for _, f in v) / len(v), 1)}
             for (r, t, k), v in sorted(groups.items())]
    config = llm.engine.config
    return {"max_num_batched_tokens": budget, "setup_s": round(setup_s, 1), "wall_s": round(wall, 2),
            "output_tokens_per_s": round(sum(r.max_tokens for r in requests) / wall, 1),
            "device_s": round(sum(s for *_, s, _ in steps), 2), "num_steps": len(steps),
            "decode_s": round(sum(s for *_, m, s, _ in steps if not m), 2),
            "mixed_s": round(sum(s for *_, m, s, _ in steps if m), 2),
            "attention_backend": config.attention_backend, "kv_cache_dtype": config.kv_cache_dtype,
            "layer_loop": config.layer_loop, "steps_by_shape": kinds}


def main(argv):
    del argv
    from experiments.benchmarks.workloads import make_trace
    from experiments.reporting.results_io import write_result
    from paged_jax.loading import load_model
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    loaded = load_model(_MODEL.value, dtype=_DTYPE.value)
    requests = make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, scale=1.0, max_model_len=2048,
                          vocab_size=loaded.config.vocab_size)
    requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, _MAX_OUTPUT.value)) for r in requests]
    runs = []
    for budget in map(int, _BUDGETS.value):
        runs.append(run_budget(loaded, requests, budget))
        r = runs[-1]
        print(f"budget {budget}: {r['output_tokens_per_s']} tok/s ({r['wall_s']} s: decode steps {r['decode_s']} s, "
              f"mixed {r['mixed_s']} s; setup {r['setup_s']} s)", flush=True)
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    figures = {"model": loaded.source, "dtype": _DTYPE.value, "best_output_tokens_per_s": best["output_tokens_per_s"],
               "best_max_num_batched_tokens": best["max_num_batched_tokens"],
               "useful_output_tokens": sum(r.max_tokens for r in requests), "runs": runs}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    for r in runs:
        for k in r["steps_by_shape"]:
            print(f"  budget {r['max_num_batched_tokens']:>5}  {k['kind']:<6} S={k['rows']:<3} T={k['tokens']:<5} "
                  f"{k['steps']:>4} steps  {k['total_s']:>6} s  {k['mean_ms']:>7} ms/step  "
                  f"{k['page_faults_per_step']:>7} page faults/step")


if __name__ == "__main__":
    app.run(main)
