"""Timing of the paged-attention kernels (no flags: a library for bench_kernel and
sweep_block_size).

`decode_point` builds one decode batch (every sequence one query at the same context
length, blocks scattered through the pool), `prefill_point` one batch of prefill chunks
(each sequence's last q_len tokens attend causally to its context); both check every
kernel against dense attention over the same K/V laid out contiguously (the same math
with no block table: the kernel's upper bound) and time the median of `iters` samples.
On a GPU a sample is `inner` calls dispatched back to back (JAX dispatches
asynchronously, so the host's dispatch overlaps the device's work) and reports the mean
call; on CPU one call. `tunings` adds the Triton kernels once per TritonTuning, named
`<kernel>@<label>`; `upstream` adds JAX's own Pallas GPU paged attention
(jax.experimental.pallas.ops.gpu.paged_attention: head-major pages, split-K) as a yardstick.
"""

from __future__ import annotations

import statistics
import time

KERNELS = ("paged_attention", "paged_attention_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference", "dense")


def median_seconds(fn, args, iters: int, inner: int = 1) -> float:
    """Median over `iters` samples of the mean time of `inner` back-to-back calls."""
    import jax
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
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


def dense_causal_attention(q, k, v):
    """Prefill attention: q [num_seqs, q_len, num_heads, head_dim], the last q_len tokens of
    contiguous K/V [num_seqs, context_len, num_kv_heads, head_dim], causal."""
    import jax
    import jax.numpy as jnp
    num_seqs, q_len, num_heads, head_dim = q.shape
    context_len, num_kv = k.shape[1], k.shape[2]
    qg = q.reshape(num_seqs, q_len, num_kv, num_heads // num_kv, head_dim)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * head_dim ** -0.5
    mask = jnp.arange(context_len)[None, :] <= (context_len - q_len + jnp.arange(q_len))[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_seqs * q_len, num_heads, head_dim).astype(q.dtype)


def _paged_batch(seed, dtype, *, block_size, num_seqs, q_len, context_len, num_heads, num_kv_heads, head_dim):
    """On JAX's default device (drawn there: a GPU-sized batch would take minutes in numpy):
    q [num_seqs, q_len, num_heads, head_dim] (the last q_len tokens of each context), K/V
    pools with each sequence's blocks scattered (null block 0 unused), the tables, context
    lengths and query_start_loc, and the same K/V laid out contiguously per sequence."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    device = jax.devices()[0]  # the default device; `backend` picks the kernels (gpu ones interpret on CPU)
    rng = np.random.default_rng(seed)
    put = lambda x: jax.device_put(x, device)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = 1 + num_seqs * blocks_per_seq
    tables = put((1 + rng.permutation(num_blocks - 1)).reshape(num_seqs, blocks_per_seq).astype(np.int32))
    key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    with jax.default_device(device):
        k, v = (jax.random.normal(key, shape, dtype) for key in (key_k, key_v))
        k_dense, v_dense = (x[tables].reshape(num_seqs, blocks_per_seq * block_size, num_kv_heads, head_dim)
                            for x in (k, v))
    q = put(jnp.asarray(rng.normal(size=(num_seqs, q_len, num_heads, head_dim)), dtype))
    lens = put(np.full(num_seqs, context_len, np.int32))
    qsl = put((np.arange(num_seqs + 1) * q_len).astype(np.int32))
    return q, k, v, tables, lens, qsl, k_dense, v_dense


def _time_all(fns, want, kv_bytes, iters, inner, flops=None):
    """{name: {ms, GB_per_s, [TFLOP_per_s], max_abs_err_vs_dense}} (or {error}) per kernel."""
    import numpy as np
    out = {}
    for name, (fn, args) in fns.items():
        try:
            seconds = median_seconds(fn, args, iters, inner)
            err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - want)))
        except Exception as e:  # a tuning Triton refuses (resources), or the upstream kernel's limits
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name}: {out[name]['error']}", flush=True)
            continue
        out[name] = {"ms": round(seconds * 1e3, 4), "GB_per_s": round(kv_bytes / seconds / 1e9, 2),
                     "max_abs_err_vs_dense": err}
        if flops is not None:
            out[name]["TFLOP_per_s"] = round(flops / seconds / 1e12, 2)
    return out


def _ratios(row, names):
    for name in names:
        if "ms" not in row.get(name, {}):
            continue
        row[f"{name}_over_dense"] = round(row[name]["ms"] / row["dense"]["ms"], 3)
        ref = row.get(f"{name.split('@')[0]}_reference", {})
        if "ms" in ref:
            row[f"{name}_over_reference"] = round(row[name]["ms"] / ref["ms"], 3)


def _upstream_paged_attention(q, k_heads, v_heads, tables, lens):
    """JAX's own Pallas GPU kernel on the same batch, its pools head-major
    [num_kv_heads, num_blocks, block_size, head_dim] (transposed once, outside the timing),
    its defaults (16-row head blocks, 8 pages per step, 16 K splits, 8 warps). It applies
    no softmax scale: q comes pre-scaled."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as upstream
    k_splits = 16
    while tables.shape[1] % k_splits:
        k_splits //= 2
    q = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
    return upstream(q, k_heads, v_heads, tables, lens, k_splits=k_splits,
                    pages_per_compute_block=min(8, tables.shape[1] // k_splits))


def decode_point(backend, block_size, num_seqs, context_len, num_heads, num_kv_heads, head_dim, dtype, iters, seed,
                 kernels=KERNELS, tunings=(), upstream=False, inner=1):
    """One row: per kernel in `kernels` (dense is always run, as the yardstick), per
    TritonTuning in `tunings` and optionally JAX's upstream kernel: median ms, GB/s of
    K/V read and max |error| against dense attention."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

    dt = jnp.dtype(dtype)
    q, k, v, tables, lens, qsl, k_dense, v_dense = _paged_batch(
        seed, dt, block_size=block_size, num_seqs=num_seqs, q_len=1, context_len=context_len, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = q[:, 0]  # decode: one query per sequence

    decode_args, ragged_args = (q, k, v, tables, lens), (q, k, v, tables, lens, qsl)
    fns = {
        "paged_attention": (jax.jit(functools.partial(paged_attention, backend=backend)), decode_args),
        "paged_attention_reference": (jax.jit(paged_attention_reference), decode_args),
        "ragged_paged_attention": (jax.jit(functools.partial(ragged_paged_attention, backend=backend)), ragged_args),
        "ragged_paged_attention_reference": (jax.jit(ragged_paged_attention_reference), ragged_args),
        "dense": (jax.jit(dense_attention), (q, k_dense, v_dense, lens)),
    }
    fns = {name: f for name, f in fns.items() if name in kernels or name == "dense"}
    for tuning in tunings:
        for name, args in (("paged_attention", decode_args), ("ragged_paged_attention", ragged_args)):
            if name in kernels:
                fn = {"paged_attention": paged_attention, "ragged_paged_attention": ragged_paged_attention}[name]
                fns[f"{name}@{tuning.label()}"] = (jax.jit(functools.partial(fn, backend=backend, tuning=tuning)),
                                                   args)
    if upstream:
        heads_major = [jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v)]
        fns["jax_upstream_paged_attention"] = (jax.jit(_upstream_paged_attention), (q, *heads_major, tables, lens))
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * dt.itemsize
    row = {"block_size": block_size, "num_seqs": num_seqs, "context_len": context_len, "num_heads": num_heads,
           "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype, "kv_bytes": kv_bytes}
    want = np.asarray(fns["dense"][0](*fns["dense"][1]), np.float32)
    row.update(_time_all(fns, want, kv_bytes, iters, inner))
    _ratios(row, [n for n in fns if n != "dense" and not n.endswith("_reference")])
    return row


def prefill_point(backend, block_size, num_seqs, q_len, context_len, num_heads, num_kv_heads, head_dim, dtype, iters,
                  seed, tunings=(), inner=1):
    """One row of prefill chunks: every sequence's last q_len of context_len tokens
    attend causally (the ragged kernel, its reference, dense causal attention): median ms,
    TFLOP/s (the causal QK^T and PV multiply-adds) and max |error| against dense."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

    dt = jnp.dtype(dtype)
    q, k, v, tables, lens, qsl, k_dense, v_dense = _paged_batch(
        seed, dt, block_size=block_size, num_seqs=num_seqs, q_len=q_len, context_len=context_len,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q_flat = q.reshape(num_seqs * q_len, num_heads, head_dim)
    args = (q_flat, k, v, tables, lens, qsl)
    fns = {"ragged_paged_attention": (jax.jit(functools.partial(ragged_paged_attention, backend=backend)), args),
           "ragged_paged_attention_reference": (jax.jit(ragged_paged_attention_reference), args),
           "dense": (jax.jit(dense_causal_attention), (q, k_dense, v_dense))}
    for tuning in tunings:
        fns[f"ragged_paged_attention@{tuning.label()}"] = (
            jax.jit(functools.partial(ragged_paged_attention, backend=backend, tuning=tuning)), args)
    # keys each query sees (causal), times 2 dots x 2 flops x head_dim, over all heads
    keys_seen = num_seqs * sum(context_len - q_len + i + 1 for i in range(q_len))
    flops = 4 * keys_seen * num_heads * head_dim
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * dt.itemsize
    row = {"block_size": block_size, "num_seqs": num_seqs, "q_len": q_len, "context_len": context_len,
           "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype,
           "flops": flops}
    want = np.asarray(fns["dense"][0](*fns["dense"][1]), np.float32)
    row.update(_time_all(fns, want, kv_bytes, iters, inner, flops=flops))
    _ratios(row, [n for n in fns if n != "dense" and not n.endswith("_reference")])
    return row
