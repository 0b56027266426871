"""Timing of the paged-attention kernels (no flags: a library for bench_kernel and
sweep_block_size).

`decode_point` builds one decode batch (every sequence one query at the same context
length, blocks scattered through the pool), `prefill_point` one batch of prefill chunks
(each sequence's last q_len tokens attend causally to its context); both check every
kernel against dense attention over the same K/V laid out contiguously (the same math
with no block table: the kernel's upper bound; for decode per sequence and kv head, the
layout a batched matmul reads as it is, where token-major K/V would be transposed, a copy
of the whole cache, in every call) and time the median of `iters` samples. `tunings` adds the
Triton kernels once per TritonTuning, named `<kernel>@<label>`; `upstream` adds JAX's
own Pallas GPU paged attention (jax.experimental.pallas.ops.gpu.paged_attention:
head-major pages, split-K) as a yardstick.

How a sample is timed (`time_interleaved`). With inner == 1 a sample is one call (the
CPU default). With inner > 1 it is one call of a jitted loop that runs the kernel about
`inner` times back to back on the device (`chained`: UNROLL calls per trip of a
lax.fori_loop), each call's query the previous call's output, so that no call can be
merged or hoisted, and an optimization barrier per call so that no work on the
loop-invariant K/V leaves the loop; the sample is the loop's time over its calls. Why:
a kernel of under 0.1 ms is about as short as the host's dispatch of one call, so calls
dispatched one by one from Python (what this did up to December 2026, with --inner=10)
timed partly the host. On an H200 a trivial op took 0.043 ms per call dispatched so, 0.013
ms chained one call per loop trip and 0.005 ms chained UNROLL = 10 per trip (records
bench_kernel_h200_decode_sweep and bench_kernel_h200, figures.timing); the same decode
kernel and launch had timed 0.082 and 0.067 ms in one dispatched run.
The kernels of a point are timed in turn, sample by sample (A B C A B C ...), so a drift
of the clock or of the host during the run touches all of them alike. `call_floor` times
the trivial op both ways, to show what is left of the host and the loop. Caveat: every
call of a point reads the same K/V, so a batch whose K/V fits the L2 cache (50 MB on an
H100 / H200) is timed warm, for every kernel alike.
"""

from __future__ import annotations

import statistics
import time

KERNELS = ("paged_attention", "paged_attention_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference", "dense")


def median_seconds(fn, args, iters: int, inner: int = 1) -> float:
    """Median over `iters` samples of the mean time of `inner` calls dispatched back to back
    from Python (JAX dispatches asynchronously; fine for calls of a millisecond or more,
    such as the device ceilings)."""
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


UNROLL = 10  # calls per trip of the timing loop


def chained(fn, inner: int):
    """(jit of (q, *rest) -> (fn(q, *rest), the query after the last call), its number of
    calls): the first call, then about inner - 1 more in a lax.fori_loop of UNROLL calls per
    trip (a trip costs the device a few microseconds of its own), each on the previous
    call's output reshaped to q (every kernel here returns q's number of elements). The
    barrier makes K/V look loop-variant, so nothing fn does to them is hoisted out."""
    import jax
    from jax import lax
    unroll = max(1, min(UNROLL, inner - 1))
    trips = -(-(inner - 1) // unroll)

    def run(q, *rest):
        first = fn(q, *rest)

        def body(_, q_i):
            for _ in range(unroll):
                q_i, *rest_i = lax.optimization_barrier((q_i, *rest))
                q_i = fn(q_i, *rest_i).reshape(q.shape).astype(q.dtype)
            return q_i

        return first, lax.fori_loop(0, trips, body, first.reshape(q.shape).astype(q.dtype))

    return jax.jit(run), 1 + unroll * trips


def time_interleaved(fns, iters: int, inner: int = 1):
    """{name: (seconds per call, first output) or the exception} for fns {name: (fn, args)}
    (args[0] the query): each compiled and warmed up, then `iters` rounds timing each once
    in turn (see the module's docstring); the median per call."""
    import jax
    runs, results = {}, {}
    for name, (fn, args) in fns.items():
        run, calls = chained(fn, inner) if inner > 1 else ((lambda *a, fn=fn: (fn(*a), None)), 1)
        try:
            first, _ = jax.block_until_ready(run(*args))  # compile
            jax.block_until_ready(run(*args))  # warm
        except Exception as e:  # a tuning Triton refuses (resources), or the upstream kernel's limits
            results[name] = e
            continue
        runs[name] = (run, calls, args, first)
    samples = {name: [] for name in runs}
    for _ in range(iters):
        for name, (run, calls, args, _) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run(*args))
            samples[name].append((time.perf_counter() - start) / calls)
    for name, (_, _, _, first) in runs.items():
        results[name] = (statistics.median(samples[name]), first)
    return results


def call_floor(iters: int, inner: int) -> dict:
    """ms per call of a trivial op (q + 1 on a 64 x 32 x 128 bf16 query), dispatched one by
    one from Python and chained in one loop: the host's and the loop's floor under a
    kernel's time."""
    import jax
    import jax.numpy as jnp
    q = jax.device_put(jnp.ones((64, 32, 128), jnp.bfloat16), jax.devices()[0])
    add = jax.jit(lambda x: x + 1)
    looped = time_interleaved({"op": (add, (q,))}, iters, inner)["op"]
    return {"dispatched_ms": round(median_seconds(add, (q,), iters, inner) * 1e3, 4),
            "chained_ms": round(looped[0] * 1e3, 4) if isinstance(looped, tuple) else None}


def dense_attention(q, k, v, lens):
    """Decode attention over contiguous head-major K/V [num_seqs, num_kv_heads, max_len, head_dim]:
    each (sequence, kv head)'s keys one run of memory, the layout a batched matmul reads as it
    is (token-major K/V would first be transposed, a copy of the whole cache per call)."""
    import jax
    import jax.numpy as jnp
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    qg = q.reshape(num_seqs, num_kv, num_heads // num_kv, head_dim)
    s = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * head_dim ** -0.5
    mask = jnp.arange(k.shape[2])[None, None, None, :] < lens[:, None, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def dense_causal_attention(q, k, v):
    """Prefill attention: q [num_seqs, q_len, num_heads, head_dim], the last q_len tokens of
    contiguous K/V [num_seqs, context_len, num_kv_heads, head_dim], causal (token-major: a
    prefill chunk is bound by its multiply-adds, not by a copy of K/V)."""
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


def _paged_batch(seed, dtype, *, block_size, num_seqs, q_len, context_len, num_heads, num_kv_heads, head_dim,
                 head_major):
    """On JAX's default device (drawn there: a GPU-sized batch would take minutes in numpy):
    q [num_seqs, q_len, num_heads, head_dim] (the last q_len tokens of each context), K/V
    pools with each sequence's blocks scattered (null block 0 unused), the tables, context
    lengths and query_start_loc, and the same K/V laid out contiguously per sequence
    [num_seqs, len, num_kv_heads, head_dim], or per sequence and kv head [num_seqs,
    num_kv_heads, len, head_dim] if head_major."""
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
        if head_major:
            k_dense, v_dense = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_dense, v_dense))
    q = put(jnp.asarray(rng.normal(size=(num_seqs, q_len, num_heads, head_dim)), dtype))
    lens = put(np.full(num_seqs, context_len, np.int32))
    qsl = put((np.arange(num_seqs + 1) * q_len).astype(np.int32))
    return q, k, v, tables, lens, qsl, k_dense, v_dense


def _time_all(fns, want, kv_bytes, iters, inner, flops=None):
    """{name: {ms, GB_per_s, [TFLOP_per_s], max_abs_err_vs_dense}} (or {error}) per kernel."""
    import numpy as np
    out = {}
    for name, result in time_interleaved(fns, iters, inner).items():
        if isinstance(result, Exception):
            out[name] = {"error": f"{type(result).__name__}: {str(result)[:300]}"}
            print(f"  {name}: {out[name]['error']}", flush=True)
            continue
        seconds, first = result
        out[name] = {"ms": round(seconds * 1e3, 4), "GB_per_s": round(kv_bytes / seconds / 1e9, 2),
                     "max_abs_err_vs_dense": float(np.max(np.abs(np.asarray(first, np.float32) - want)))}
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
        num_kv_heads=num_kv_heads, head_dim=head_dim, head_major=True)
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
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, head_major=False)
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
