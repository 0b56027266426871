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
import statistics
import time

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


def _median_seconds(fn, args, iters: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dense_attention(q, k, v, lens):
    """Decode attention over contiguous K/V [num_seqs, max_len, num_kv_heads, head_dim]."""
    import jax
    import jax.numpy as jnp
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    qg = q.reshape(num_seqs, num_kv, num_heads // num_kv, head_dim)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) * head_dim ** -0.5
    mask = jnp.arange(k.shape[1])[None, None, None, :] < lens[:, None, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def _point(backend, block_size, num_seqs, context_len, num_heads, num_kv_heads, head_dim, dtype, iters, seed):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

    device = jax.devices(backend)[0]
    rng = np.random.default_rng(seed)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = 1 + num_seqs * blocks_per_seq
    put = lambda x: jax.device_put(x, device)
    dt = jnp.dtype(dtype)
    k = rng.normal(size=(num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    q = rng.normal(size=(num_seqs, num_heads, head_dim)).astype(np.float32)
    tables = (1 + rng.permutation(num_blocks - 1)).reshape(num_seqs, blocks_per_seq).astype(np.int32)
    lens = np.full(num_seqs, context_len, np.int32)
    qsl = np.arange(num_seqs + 1, dtype=np.int32)
    # the same K/V laid out contiguously per sequence, for dense attention
    k_dense = k[tables].reshape(num_seqs, blocks_per_seq * block_size, num_kv_heads, head_dim)
    v_dense = v[tables].reshape(k_dense.shape)
    q, k, v, k_dense, v_dense = (put(jnp.asarray(x, dt)) for x in (q, k, v, k_dense, v_dense))
    tables, lens, qsl = put(tables), put(lens), put(qsl)

    fns = {
        "paged_attention": (jax.jit(functools.partial(paged_attention, backend=backend)), (q, k, v, tables, lens)),
        "paged_attention_reference": (jax.jit(paged_attention_reference), (q, k, v, tables, lens)),
        "ragged_paged_attention": (jax.jit(functools.partial(ragged_paged_attention, backend=backend)),
                                   (q, k, v, tables, lens, qsl)),
        "ragged_paged_attention_reference": (jax.jit(ragged_paged_attention_reference), (q, k, v, tables, lens, qsl)),
        "dense": (jax.jit(_dense_attention), (q, k_dense, v_dense, lens)),
    }
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * dt.itemsize
    row = {"block_size": block_size, "num_seqs": num_seqs, "context_len": context_len, "num_heads": num_heads,
           "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype}
    want = np.asarray(fns["dense"][0](*fns["dense"][1]), np.float32)
    for name, (fn, args) in fns.items():
        seconds = _median_seconds(fn, args, iters)
        err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - want)))
        row[name] = {"ms": round(seconds * 1e3, 4), "GB_per_s": round(kv_bytes / seconds / 1e9, 2),
                     "max_abs_err_vs_dense": err}
    for name in ("paged_attention", "ragged_paged_attention"):
        row[f"{name}_over_dense"] = round(row[name]["ms"] / row["dense"]["ms"], 3)
        row[f"{name}_over_reference"] = round(row[name]["ms"] / row[f"{name}_reference"]["ms"], 3)
    return row


def main(argv):
    del argv
    import jax

    from experiments.results_io import write_result
    backend = _BACKEND.value or jax.default_backend()
    ints = lambda values: [int(x) for x in values]
    grid = list(itertools.product(ints(_BLOCK_SIZE.value), ints(_NUM_SEQS.value), ints(_CONTEXT_LEN.value),
                                  ints(_NUM_HEADS.value), ints(_NUM_KV_HEADS.value), ints(_HEAD_DIM.value),
                                  _DTYPE.value))
    rows = []
    for point in grid:
        rows.append(_point(backend, *point, iters=_ITERS.value, seed=_SEED.value))
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
