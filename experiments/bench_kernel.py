"""Paged-attention kernels against the jnp reference and dense attention, decode shapes.

    python -m experiments.bench_kernel                         # SmolLM2's shape, a small sweep
    python -m experiments.bench_kernel --num_seqs=8,32 --context_len=512,2048 --backend=gpu

Every flag takes a comma-separated list; the run sweeps their product. For each point:
the decode kernel (`paged_attention`), the ragged kernel on one query per sequence
(`ragged_paged_attention`), their jnp references (gather through the block table, then
dense softmax), and dense attention over contiguous K/V of the same lengths (the same
math with no block table: the kernel's upper bound). Times are medians of --iters calls
after warm-up; GB/s counts the K/V bytes each call must read. Writes
experiments/results/bench_kernel[_<tag>].json.
"""

from __future__ import annotations

import itertools

from absl import app, flags

_BLOCK_SIZE = flags.DEFINE_list("block_size", ["16"], "Tokens per KV block.")
_NUM_SEQS = flags.DEFINE_list("num_seqs", ["8", "32"], "Sequences in the batch (one query each).")
_CONTEXT_LEN = flags.DEFINE_list("context_len", ["512", "2048"], "Context length of every sequence.")
_NUM_HEADS = flags.DEFINE_list("num_heads", ["9"], "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_list("num_kv_heads", ["3"], "Key/value heads.")
_HEAD_DIM = flags.DEFINE_list("head_dim", ["64"], "Head dimension.")
_DTYPE = flags.DEFINE_list("dtype", ["float32"], "float32 and/or bfloat16.")
_BACKEND = flags.DEFINE_string("backend", None, "cpu, gpu or tpu (default: JAX's default backend).")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed calls per measurement (median reported).")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the results file name (e.g. the device).")
_SEED = flags.DEFINE_integer("seed", 0, "Data seed.")


def main(argv):
    del argv
    import jax

    from experiments.benchmarks.kernel_timing import decode_point
    from experiments.reporting.results_io import write_result
    backend = _BACKEND.value or jax.default_backend()
    ints = lambda values: [int(x) for x in values]
    grid = list(itertools.product(ints(_BLOCK_SIZE.value), ints(_NUM_SEQS.value), ints(_CONTEXT_LEN.value),
                                  ints(_NUM_HEADS.value), ints(_NUM_KV_HEADS.value), ints(_HEAD_DIM.value),
                                  _DTYPE.value))
    rows = []
    for point in grid:
        rows.append(decode_point(backend, *point, iters=_ITERS.value, seed=_SEED.value))
        r = rows[-1]
        print(f"bs={r['block_size']:>3} seqs={r['num_seqs']:>3} ctx={r['context_len']:>5} {r['dtype']:>8}: "
              f"kernel {r['paged_attention']['ms']:9.3f} ms  ragged {r['ragged_paged_attention']['ms']:9.3f} ms  "
              f"reference {r['paged_attention_reference']['ms']:9.3f} ms  dense {r['dense']['ms']:9.3f} ms  "
              f"kernel/ref {r['paged_attention_over_reference']:.2f}  ragged/ref "
              f"{r['ragged_paged_attention_over_reference']:.2f}  kernel/dense {r['paged_attention_over_dense']:.2f}",
              flush=True)
    name = "bench_kernel" + (f"_{_TAG.value}" if _TAG.value else "")
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(name, flags=flag_values, figures={"backend": backend, "points": rows},
                                seed=_SEED.value))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
