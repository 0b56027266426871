"""Block size: KV utilization, throughput and kernel time (the paper's Fig. 18b), and
preemption by recompute vs swap under a tight KV budget (its Fig. 19).

    python -m experiments.sweep_block_size                                  # SmolLM2, the default sweep
    python -m experiments.sweep_block_size --model=tiny_llama --block_sizes=8,32 --num_requests=8   # fast

Why: a block is the unit of allocation, sharing and kernel work. Small blocks waste
less of each sequence's last block but make the kernel walk longer block tables and
move KV in small pieces when swapping; large blocks waste more memory per sequence,
which at one KV budget means fewer requests in a batch. The paper finds 16-128 best on
ShareGPT and 16-32 on Alpaca, and that swapping loses to recomputation at small blocks.

Part 1, per workload x block size: one seeded trace (all requests at t = 0, ignore_eos)
on a fresh engine with the same KV byte budget (--kv_cache_memory_bytes; the number of
blocks follows from the block size), recording kv_utilization, saturated mean batched
requests, output tokens/s, and the ragged kernel's time on a fixed decode batch
(--kernel_num_seqs x --kernel_context_len, SmolLM2's heads) next to its jnp reference.
Part 2, per block size x preemption mode: the first workload's trace under a budget of
--tight_kv_seqs max-length sequences, where preemption must happen; throughput, number
of preemptions and wall time for "recompute" and "swap".

Every engine uses the same small buckets (--seq_buckets, --token_buckets), so the
compiled programs differ only by block size and the persistent compilation cache
serves the second mode and workload. Writes experiments/results/sweep_block_size.json.
"""

from __future__ import annotations

import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset (random "
                                                      "weights: fast, not for claims).")
_WORKLOADS = flags.DEFINE_list("workloads", ["sharegpt", "alpaca"], "Workloads of part 1 (the first is part 2's).")
_BLOCK_SIZES = flags.DEFINE_list("block_sizes", ["1", "2", "4", "8", "16", "32", "64", "128", "256"],
                                 "Block sizes (tokens per KV block).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 48, "Requests per trace (all at t = 0).")
_SCALE = flags.DEFINE_float("scale", 0.25, "Length scale of the traces (1.0: the data sets' means).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "Engine max_model_len (and the traces' cap).")
_KV_BYTES = flags.DEFINE_integer("kv_cache_memory_bytes", 96 * 2**20, "Part 1's KV budget in bytes (every "
                                                                       "block size).")
_TIGHT_KV_SEQS = flags.DEFINE_integer("tight_kv_seqs", 2, "Part 2's KV budget in max_model_len-long sequences.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 128, "Tokens per step.")
_SEQ_BUCKETS = flags.DEFINE_list("seq_buckets", ["8", "32"], "Padded batch sizes (few: each compiles per block size).")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", ["32", "128"], "Padded token counts.")
_KERNEL_NUM_SEQS = flags.DEFINE_integer("kernel_num_seqs", 16, "Kernel timing: sequences in the decode batch.")
_KERNEL_CONTEXT = flags.DEFINE_integer("kernel_context_len", 256, "Kernel timing: context of each sequence.")
_KERNEL_ITERS = flags.DEFINE_integer("kernel_iters", 5, "Kernel timing: timed calls (median reported).")
_SKIP_PREEMPTION = flags.DEFINE_bool("skip_preemption", False, "Run part 1 only.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_OUTPUT = flags.DEFINE_string("output", "sweep_block_size", "Result name: experiments/results/<output>.json.")


def _run(model, trace, settings: dict) -> dict:
    """One engine on one trace: its stats and throughput (warm-up excluded)."""
    from experiments.reporting.results_io import round_or_none
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    llm = LLM(model, paper_metrics=True, **settings)  # kv_utilization
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in trace]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in trace]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(r.max_tokens for r in trace), "ignore_eos: every request runs to its max_tokens"
    assert stats["num_compilations_after_warm_up"] == 0
    return {"kv_utilization": round(stats["kv_utilization"], 4),
            "saturated_mean_batched_seqs": round_or_none(stats["saturated_mean_batched_seqs"], 2),  # None: none waited
            "mean_batched_seqs": round(stats["mean_batched_seqs"], 2), "num_blocks": stats["num_blocks_total"],
            "output_tokens_per_s": round(tokens / seconds, 2), "wall_seconds": round(seconds, 2),
            "num_preemptions": stats["num_preemptions"], "output_tokens": tokens,
            "device_seconds_per_step": round(stats["device_seconds_per_step"], 5)}


def main(argv):
    del argv
    import jax

    from experiments.bench_models import load_for_benchmark
    from experiments.benchmarks.kernel_timing import decode_point
    from experiments.reporting.results_io import write_result
    from experiments.benchmarks.workloads import make_trace
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    block_sizes = [int(b) for b in _BLOCK_SIZES.value]
    max_len = _MAX_MODEL_LEN.value
    model = load_for_benchmark(_MODEL.value, max_len)
    cfg = model.config
    traces = {w: make_trace(w, _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value, max_model_len=max_len,
                            vocab_size=cfg.vocab_size) for w in _WORKLOADS.value}
    common = {"max_model_len": max_len, "max_num_seqs": _MAX_NUM_SEQS.value,
              "max_num_batched_tokens": _MAX_BATCHED.value, "enable_prefix_caching": False,
              "seq_buckets": tuple(int(b) for b in _SEQ_BUCKETS.value),
              "token_buckets": tuple(int(b) for b in _TOKEN_BUCKETS.value)}
    rows, preemption, kernel = [], [], []
    for block_size in block_sizes:
        k = decode_point(jax.default_backend(), block_size, _KERNEL_NUM_SEQS.value, _KERNEL_CONTEXT.value,
                         cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "float32", _KERNEL_ITERS.value, _SEED.value,
                         kernels=("ragged_paged_attention", "ragged_paged_attention_reference"))
        kernel.append({"block_size": block_size, "kernel_ms": k["ragged_paged_attention"]["ms"],
                       "reference_ms": k["ragged_paged_attention_reference"]["ms"], "dense_ms": k["dense"]["ms"],
                       "max_abs_err_vs_dense": k["ragged_paged_attention"]["max_abs_err_vs_dense"]})
        for workload, trace in traces.items():
            row = _run(model, trace, {**common, "block_size": block_size,
                                           "kv_cache_memory_bytes": _KV_BYTES.value})
            rows.append({"workload": workload, "block_size": block_size, **row,
                         "kernel_ms": kernel[-1]["kernel_ms"]})
            print(f"{workload:>8} block {block_size:>3}: utilization {row['kv_utilization']:.3f}, batch "
                  f"{row['saturated_mean_batched_seqs'] or row['mean_batched_seqs']:.1f}, {row['output_tokens_per_s']:.1f} tok/s, kernel "
                  f"{kernel[-1]['kernel_ms']:.2f} ms", flush=True)
        if _SKIP_PREEMPTION.value:
            continue
        tight = _TIGHT_KV_SEQS.value * -(-max_len // block_size) + 1
        for mode in ("recompute", "swap"):
            row = _run(model, traces[_WORKLOADS.value[0]], {**common, "block_size": block_size,
                                                                 "num_blocks": tight, "preemption_mode": mode})
            preemption.append({"block_size": block_size, "preemption_mode": mode, **row})
            print(f"   tight block {block_size:>3} {mode:>9}: {row['num_preemptions']} preemptions, "
                  f"{row['output_tokens_per_s']:.1f} tok/s", flush=True)
    figures = {"model": model.source, "workloads": _WORKLOADS.value, "engine_settings": common,
               "kv_cache_memory_bytes": _KV_BYTES.value, "rows": rows, "kernel": kernel, "preemption": preemption}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    print(f"\n{'workload':>8} {'block':>5} {'util':>6} {'batch':>6} {'tok/s':>7} {'kernel ms':>9}")
    for r in rows:
        print(f"{r['workload']:>8} {r['block_size']:>5} {r['kv_utilization']:>6.3f} "
              f"{r['saturated_mean_batched_seqs'] or r['mean_batched_seqs']:>6.1f} {r['output_tokens_per_s']:>7.1f} "
              f"{r['kernel_ms']:>9.2f}")
    for r in preemption:
        print(f"{'tight':>8} {r['block_size']:>5} {r['preemption_mode']:>9} {r['num_preemptions']:>4} preemptions "
              f"{r['output_tokens_per_s']:>7.1f} tok/s")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
