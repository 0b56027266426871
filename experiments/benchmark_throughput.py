"""Offline throughput and KV utilization: paged blocks against contiguous reservations.

    python -m experiments.benchmark_throughput --scale=0.25 --num_requests=150
    python -m experiments.benchmark_throughput --model=tiny_llama --num_requests=32   # fast, random weights

Why: the paper's Fig. 2 / Sec. 6 argue that systems reserving one contiguous chunk per
request (Orca with max / pow2 / oracle reservations) keep only 20.4%-38.2% of their KV
memory holding tokens, so they batch fewer requests and serve fewer tokens per second
than PagedAttention at the same memory. Here each allocator runs the same seeded trace
(--workload, all requests at t = 0, ignore_eos so output lengths are the trace's) on a
fresh LLM with the same model, KV budget and scheduler; only `kv_allocator` differs.

The KV budget defaults to --kv_seqs max_model_len-long sequences (blocks of
--block_size, plus the null block), small enough that memory, not --max_num_seqs, limits
batching; --num_blocks or --kv_cache_memory_bytes set it directly. Per allocator the
record holds the engine's stats: kv_utilization (tokens held / slots allocated, mean over
steps), the waste split in token slots per step (internal: reserved never to be used;
reservation: reserved for later tokens; external: free in gaps too short for the next
waiting request), mean / max batched requests per step, the mean over "saturated" steps
(those that left requests waiting: the batch the budget admits, the paper's batched
requests; the plain mean also counts the drain at the end, where the trace's long tail
runs nearly alone), batched requests per step over time, preemptions, and throughput
(requests/s, output tokens/s over the wall time of the run, warm-up excluded; and
tokens sampled per second over the saturated steps alone: the throughput the budget
sustains while there is work, the paper's measure; the whole-run figure also counts the
drain, whose length is set by the trace's longest requests, not by the allocator).
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

from paged_jax.config.engine_config import KV_ALLOCATORS

TIMELINE_POINTS = 400  # batched sequences per step, sampled to at most about this many points
ALLOCATORS = KV_ALLOCATORS

_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Length statistics of the trace.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 150, "Requests in the trace (all at t = 0).")
_SCALE = flags.DEFINE_float("scale", 0.25, "Length scale of the trace (1.0: the data set's means).")
_ALLOCATORS = flags.DEFINE_list("kv_allocator", list(ALLOCATORS), "KV allocators to run, in order.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block (every allocator).")
_KV_SEQS = flags.DEFINE_integer("kv_seqs", 8, "KV budget in max_model_len-long sequences (unless --num_blocks "
                                              "or --kv_cache_memory_bytes is given).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", None, "KV blocks incl. the null block (overrides --kv_seqs).")
_KV_BYTES = flags.DEFINE_integer("kv_cache_memory_bytes", None, "KV budget in bytes (overrides --kv_seqs).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 1024, "Engine max_model_len (and the trace's cap).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 128, "Sequences per step (high: memory limits batching).")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source), or a tiny_* configs preset "
                                                      "(e.g. tiny_llama) with random weights: fast, not for claims.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_OUTPUT = flags.DEFINE_string("output", "benchmark_throughput", "Result name: experiments/results/<output>.json.")


def main(argv):
    del argv
    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import round_or_none, write_result
    from experiments.benchmarks.workloads import make_trace
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    if set(_ALLOCATORS.value) - set(ALLOCATORS):
        raise app.UsageError(f"--kv_allocator must be among {ALLOCATORS}; got {_ALLOCATORS.value}")
    enable_compilation_cache()
    model = load_for_benchmark(_MODEL.value, _MAX_MODEL_LEN.value)
    max_len = _MAX_MODEL_LEN.value
    trace = make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value,
                       max_model_len=max_len, vocab_size=model.config.vocab_size)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in trace]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in trace]
    prompt_lens = [len(r.prompt_token_ids) for r in trace]
    output_lens = [r.max_tokens for r in trace]
    budget = {}
    if _KV_BYTES.value is not None:
        budget["kv_cache_memory_bytes"] = _KV_BYTES.value
    else:
        budget["num_blocks"] = _NUM_BLOCKS.value or _KV_SEQS.value * -(-max_len // _BLOCK_SIZE.value) + 1
    settings = {"block_size": _BLOCK_SIZE.value, "max_model_len": max_len, "max_num_seqs": _MAX_NUM_SEQS.value,
                "max_num_batched_tokens": _MAX_BATCHED.value, "enable_prefix_caching": False, **budget}
    print(f"{len(trace)} {_WORKLOAD.value}-like requests (scale {_SCALE.value}): mean prompt "
          f"{statistics.mean(prompt_lens):.1f}, mean output {statistics.mean(output_lens):.1f} tokens; "
          f"{model.source}; {settings}; load average {os.getloadavg()}")
    rows = []
    for allocator in _ALLOCATORS.value:
        llm = LLM(model, kv_allocator=allocator, paper_metrics=True, **settings)  # warm-up (compilation) happens here
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - start
        stats = llm.stats()
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert output_tokens == sum(output_lens), "ignore_eos: every request runs to its max_tokens"
        batched = [entry[0] for entry in llm.engine.stats_tracker.step_log]  # the last STEP_LOG_LENGTH steps
        stride = max(1, len(batched) // TIMELINE_POINTS)
        rows.append({
            "kv_allocator": allocator, "kv_utilization": round(stats["kv_utilization"], 4),
            "waste_internal_slots": round(stats["waste_internal_slots"], 1),
            "waste_reservation_slots": round(stats["waste_reservation_slots"], 1),
            "waste_external_slots": round(stats["waste_external_slots"], 1),
            "mean_batched_seqs": round(stats["mean_batched_seqs"], 2), "max_batched_seqs": stats["max_batched_seqs"],
            "saturated_mean_batched_seqs": round_or_none(stats["saturated_mean_batched_seqs"], 2),  # None: none waited
            "num_saturated_steps": stats["num_saturated_steps"],
            "batched_seqs_timeline": batched[::stride], "timeline_stride": stride,
            "timeline_complete": stats["num_steps"] == len(batched),
            "requests_per_s": round(len(outputs) / seconds, 4),
            "output_tokens_per_s": round(output_tokens / seconds, 2), "wall_seconds": round(seconds, 2),
            "saturated_tokens_per_s": round_or_none(stats["saturated_tokens_per_s"], 2),
            "num_preemptions": stats["num_preemptions"], "num_steps": stats["num_steps"],
            "num_blocks_total": stats["num_blocks_total"], "output_tokens": output_tokens,
            "num_compilations_after_warm_up": stats["num_compilations_after_warm_up"]})
        del llm
    by = {r["kv_allocator"]: r for r in rows}
    ratios = {}
    if "paged" in by:
        for other in by.keys() - {"paged"}:
            ratios[f"batched_paged_over_{other}"] = round(
                by["paged"]["mean_batched_seqs"] / by[other]["mean_batched_seqs"], 2)
            if by[other]["saturated_mean_batched_seqs"]:
                ratios[f"saturated_batched_paged_over_{other}"] = round(
                    by["paged"]["saturated_mean_batched_seqs"] / by[other]["saturated_mean_batched_seqs"], 2)
            ratios[f"throughput_paged_over_{other}"] = round(
                by["paged"]["output_tokens_per_s"] / by[other]["output_tokens_per_s"], 2)
            if by["paged"]["saturated_tokens_per_s"] and by[other]["saturated_tokens_per_s"]:
                ratios[f"saturated_throughput_paged_over_{other}"] = round(
                    by["paged"]["saturated_tokens_per_s"] / by[other]["saturated_tokens_per_s"], 2)
    figures = {"model": model.source, "dtype": "float32", "workload": _WORKLOAD.value, "engine_settings": settings,
               "mean_prompt_tokens": statistics.mean(prompt_lens), "mean_output_tokens": statistics.mean(output_lens),
               "allocators": rows, "ratios": ratios, "paper_utilization_existing_systems": [0.204, 0.382],
               "load_average_end": os.getloadavg()}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    print(f"\n{'allocator':>17} {'util':>6} {'internal':>8} {'reserv.':>8} {'extern.':>8} {'batch':>6} {'sat.':>6} {'max':>4} "
          f"{'req/s':>7} {'tok/s':>7} {'sat.':>7} {'wall s':>7} {'preempt':>7}")
    for r in rows:
        print(f"{r['kv_allocator']:>17} {r['kv_utilization']:>6.3f} {r['waste_internal_slots']:>8.1f} "
              f"{r['waste_reservation_slots']:>8.1f} {r['waste_external_slots']:>8.1f} {r['mean_batched_seqs']:>6.2f} "
              f"{r['saturated_mean_batched_seqs'] or float('nan'):>6.2f} "
              f"{r['max_batched_seqs']:>4} {r['requests_per_s']:>7.3f} {r['output_tokens_per_s']:>7.1f} "
              f"{r['saturated_tokens_per_s'] or float('nan'):>7.1f} "
              f"{r['wall_seconds']:>7.1f} {r['num_preemptions']:>7}")
    for name, value in sorted(ratios.items()):
        print(f"{name}: {value}")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
