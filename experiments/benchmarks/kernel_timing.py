"""Timing of the paged-attention kernels on decode shapes (no flags: a library for
bench_kernel and sweep_block_size).

`decode_point` builds one decode batch (every sequence one query at the same context
length, blocks scattered through the pool), checks each kernel against dense attention
over the same K/V laid out contiguously, and times the median of `iters` calls.
"""

from __future__ import annotations

import statistics
import time

KERNELS = ("paged_attention", "paged_attention_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference", "dense")


def median_seconds(fn, args, iters: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_attention(q, k, v, lens):
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


def decode_point(backend, block_size, num_seqs, context_len, num_heads, num_kv_heads, head_dim, dtype, iters, seed,
                 kernels=KERNELS):
    """One row: per kernel in `kernels` (dense is always run, as the yardstick) its
    median ms, GB/s of K/V read and max |error| against dense attention."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import (
        paged_attention,
        paged_attention_reference,
    )
    from pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention,
        ragged_paged_attention_reference,
    )

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
        "dense": (jax.jit(dense_attention), (q, k_dense, v_dense, lens)),
    }
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * dt.itemsize
    row = {"block_size": block_size, "num_seqs": num_seqs, "context_len": context_len, "num_heads": num_heads,
           "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype}
    want = np.asarray(fns["dense"][0](*fns["dense"][1]), np.float32)
    for name, (fn, args) in fns.items():
        if name not in kernels and name != "dense":
            continue
        seconds = median_seconds(fn, args, iters)
        err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - want)))
        row[name] = {"ms": round(seconds * 1e3, 4), "GB_per_s": round(kv_bytes / seconds / 1e9, 2),
                     "max_abs_err_vs_dense": err}
    for name in ("paged_attention", "ragged_paged_attention"):
        if name not in row or f"{name}_reference" not in row:
            continue
        row[f"{name}_over_dense"] = round(row[name]["ms"] / row["dense"]["ms"], 3)
        row[f"{name}_over_reference"] = round(row[name]["ms"] / row[f"{name}_reference"]["ms"], 3)
    return row
