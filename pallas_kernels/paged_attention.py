"""Paged attention for decode: one query token per sequence, K/V read through a block table.

Sequence i has context_lens[i] tokens in the paged cache; token t lives in physical block
block_tables[i, t // block_size] at row t % block_size. Its single query is the last
token (position context_lens[i] - 1) and attends to every cached token of the sequence
(or, with a sliding window W, to the last W of them). This is the decode step of the
paper's PagedAttention: the kernel walks the sequence's blocks one at a time with an
online softmax and never gathers the sequence's K/V into a contiguous array.

File layout (DESIGN.md, "Kernels"):
  * `paged_attention_reference`: pure jnp (gather through the table, dense masked
    softmax), the ground truth; the ragged reference with one query per sequence.
  * `paged_attention_kernel`: one program per (sequence, kv head) computing the whole
    GQA group of query heads, a `lax.fori_loop` over the sequence's used blocks only. It
    lowers to Triton on GPU and runs in interpret mode on CPU, where this grid measured
    1.2-1.4x a single looping program (SmolLM2 shapes, 2 cores) and its time does not
    grow with the cache size: CPU keeps the GPU kernel rather than a layout of its own.
  * `paged_attention_tpu_kernel`: Mosaic TPU: block tables and context lengths
    scalar-prefetched into SMEM, the cache left in HBM (`pl.ANY`), each block's K/V copied
    into a double-buffered VMEM scratch by async DMA while the previous block computes.
  * `paged_attention`: the jitted public function; checks shapes and picks a backend.

Invariants every variant keeps: keys at positions >= context_len (the tail of the last
block, table padding) are masked out of the scores *and* zeroed in the values, so unused
cache slots may hold anything, NaN included; a sequence with context_len 0 gets zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

_BACKENDS = ("cpu", "gpu", "cuda", "rocm", "tpu")
# Triton's tensors need power-of-two sizes and its dot needs each dimension >= 16.
_TRITON_MIN_DIM = 16


# ---------------------------------------------------------------------------- checks


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim]; got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q and the caches must be floating point; got {q.dtype}")
    num_seqs, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the cache's {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq]; "
                         f"got {block_tables.shape}")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}]; got {context_lens.shape}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got {arr.dtype}")


# ------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None,
                              sliding_window=None, soft_cap=None):
    """Reference decode paged attention (gather through the table, dense masked softmax).

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables i32[num_seqs, max_blocks_per_seq];
    context_lens i32[num_seqs] (0 allowed: that row's output is zero). The query of
    sequence i sits at position context_lens[i] - 1. sm_scale defaults to
    head_dim ** -0.5; sliding_window W keeps keys at positions > position - W;
    soft_cap c maps scores s to c * tanh(s / c).
    Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    # decode is the ragged case with exactly one query row per sequence
    query_start_loc = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


# -------------------------------------------------------------- shared kernel math


def _block_range(context_len, block_size: int, max_blocks_per_seq: int, sliding_window: int | None):
    """[first, end) logical blocks holding keys the query at context_len - 1 may attend to.

    Every block in the range holds at least one such key; the range is empty for
    context_len 0. end never passes the table's width, so the table is never read past
    its row even if context_len exceeds the table's capacity (like the reference, keys
    past the table are then absent).
    """
    # lax.div truncates, which is floor division here (no negatives); jnp's `//` adds a
    # sign fix-up whose Mosaic lowering asks for the TPU generation, so export on a
    # machine without a TPU would fail
    end = jnp.minimum(lax.div(context_len + (block_size - 1), block_size), max_blocks_per_seq)
    if sliding_window is None:
        return 0, end
    return lax.div(jnp.maximum(context_len - sliding_window, 0), block_size), end


def _key_mask(key_pos, context_len, sliding_window: int | None):
    """True for the key positions the decode query (at context_len - 1) attends to."""
    mask = key_pos < context_len
    if sliding_window is not None:
        mask &= key_pos >= context_len - sliding_window
    return mask


def _precision(dtype, backend: str):
    """f32 dots in full f32 (the defaults are TF32 on Triton, bf16 passes on TPU); bf16
    dots plain, except on Triton where HIGHEST is what asks for no TF32 flag."""
    if dtype == jnp.float32 or backend == "triton":
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def _scores(q, k, sm_scale: float, soft_cap: float | None, precision):
    """q [rows, head_dim] . k [keys, head_dim] -> f32[rows, keys], scaled and capped."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _pv(p, v, precision):
    """p f32[rows, keys] . v [keys, head_dim] -> f32[rows, head_dim] (p rounded to v's dtype)."""
    return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _online_softmax_step(carry, scores, mask, pv):
    """Folds one block into the running (max, sum, accumulator) of a group of query rows.

    carry: m, l f32[rows, 1], acc f32[rows, head_dim]; scores f32[rows, keys]; mask
    bool[1, keys]; pv(p) is p @ V for the block, f32[rows, head_dim].
    """
    m_prev, l_prev, acc_prev = carry
    scores = jnp.where(mask, scores, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # an all-masked row keeps exp() at 0, not NaN
    correction = jnp.exp(m_prev - m_safe)
    p = jnp.exp(scores - m_safe)
    l_next = correction * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_next = correction * acc_prev + pv(p)
    return m_next, l_next, acc_next


def _init_state(rows: int, head_dim: int):
    return (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def _finish(l, acc):
    """acc / l, and zeros where nothing was attended to (context_len 0)."""
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)


# ----------------------------------------------- GPU (Triton) and interpret: the kernel


def paged_attention_kernel(
        block_tables_ref,  # i32[num_seqs, max_blocks_per_seq] (whole array)
        context_lens_ref,  # i32[num_seqs] (whole array)
        q_ref,  # [group_rows, head_dim_padded]: the query heads of one kv head of one sequence
        k_cache_ref,  # [num_blocks, block_size, num_kv_heads, head_dim_padded] (whole cache)
        v_cache_ref,  # [num_blocks, block_size, num_kv_heads, head_dim_padded]
        o_ref,  # [group_rows, head_dim_padded]
        *, head_dim: int, sm_scale: float, sliding_window: int | None, soft_cap: float | None):
    """Program (sequence, kv head): online softmax over the sequence's used blocks only.

    For Triton the wrapper pads group_rows and head_dim to powers of two >= 16: padded
    query rows are zero and dropped afterwards, padded head dims are masked on load.
    """
    seq, kv_head = pl.program_id(0), pl.program_id(1)
    group_rows, head_dim_padded = q_ref.shape
    block_size = k_cache_ref.shape[1]
    context_len = context_lens_ref[seq]
    first, end = _block_range(context_len, block_size, block_tables_ref.shape[1], sliding_window)
    dim_mask = None
    if head_dim != head_dim_padded:
        dim_mask = lax.broadcasted_iota(jnp.int32, (block_size, head_dim_padded), 1) < head_dim

    def load_block(cache_ref, block_id):  # [block_size, head_dim_padded], read in place
        view = cache_ref.at[block_id, :, kv_head, :]
        return view[...] if dim_mask is None else plgpu.load(view, mask=dim_mask, other=0)

    q = q_ref[...]
    # Triton's dot needs >= 16 keys; a smaller block is reduced by hand (same math)
    use_dot = block_size >= _TRITON_MIN_DIM

    def body(logical_block, carry):
        block_id = block_tables_ref[seq, logical_block]
        k = load_block(k_cache_ref, block_id)
        v = load_block(v_cache_ref, block_id)
        start = logical_block * block_size
        mask = _key_mask(start + lax.broadcasted_iota(jnp.int32, (1, block_size), 1), context_len,
                         sliding_window)  # [1, block_size], for the scores
        row_mask = _key_mask(start + lax.broadcasted_iota(jnp.int32, (block_size, 1), 0), context_len,
                             sliding_window)  # [block_size, 1], for the values
        # slots past the context may hold NaN, and 0 * NaN is NaN: zero them
        v = jnp.where(row_mask, v, 0)
        if use_dot:
            precision = _precision(q.dtype, "triton")
            return _online_softmax_step(carry, _scores(q, k, sm_scale, soft_cap, precision), mask,
                                        lambda p: _pv(p, v, precision))
        s = jnp.sum(q[:, None, :].astype(jnp.float32) * k[None, :, :].astype(jnp.float32), axis=2) * sm_scale
        s = s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)
        pv = lambda p: jnp.sum(p[:, :, None] * v[None, :, :].astype(jnp.float32), axis=1)
        return _online_softmax_step(carry, s, mask, pv)

    _, l, acc = lax.fori_loop(first, end, body, _init_state(group_rows, head_dim_padded))
    o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def _paged_attention_call(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale, sliding_window,
                          soft_cap, interpret, pad_for_triton):
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_rows, head_dim_padded = group, head_dim
    if pad_for_triton:
        group_rows = max(_TRITON_MIN_DIM, pl.next_power_of_2(group))
        head_dim_padded = max(_TRITON_MIN_DIM, pl.next_power_of_2(head_dim))
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_rows - group), (0, head_dim_padded - head_dim)))
    whole = lambda shape: pl.BlockSpec(shape, lambda s, h: (0,) * len(shape))
    # the cache's block is the whole cache (head_dim rounded up for Triton: a padded block
    # whose extra columns the kernel masks); the kernel indexes blocks through the table
    cache_spec = whole((num_blocks, block_size, num_kv_heads, head_dim_padded))
    group_spec = pl.BlockSpec((None, None, group_rows, head_dim_padded), lambda s, h: (s, h, 0, 0))
    kernel = functools.partial(paged_attention_kernel, head_dim=head_dim, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads),
        in_specs=[whole(block_tables.shape), whole(context_lens.shape), group_spec, cache_spec, cache_spec],
        out_specs=group_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="paged_attention_decode",
    )(block_tables, context_lens, qg, k_cache, v_cache)
    return out[:, :, :group, :head_dim].reshape(num_seqs, num_heads, head_dim)


# --------------------------------------------------------------------- TPU (Mosaic)


def paged_attention_tpu_kernel(
        block_tables_ref,  # SMEM i32[num_seqs * max_blocks_per_seq] (scalar prefetch, flattened)
        context_lens_ref,  # SMEM i32[num_seqs] (scalar prefetch)
        q_ref,  # VMEM [num_kv_heads, group, head_dim]: all query heads of one sequence
        k_cache_hbm_ref,  # HBM [num_blocks, block_size, num_kv_heads, head_dim] (pl.ANY, never copied whole)
        v_cache_hbm_ref,  # HBM [num_blocks, block_size, num_kv_heads, head_dim]
        o_ref,  # VMEM [num_kv_heads, group, head_dim]
        k_buffer,  # VMEM scratch [2, block_size, num_kv_heads, head_dim]: double buffer
        v_buffer,  # VMEM scratch [2, block_size, num_kv_heads, head_dim]
        sems,  # DMA semaphores [2 (k, v), 2 (buffer slot)]
        *, max_blocks_per_seq: int, sm_scale: float, sliding_window: int | None, soft_cap: float | None):
    """Program (sequence): DMA block i + 1 while computing block i, every kv head per block.

    A block is one contiguous [block_size, num_kv_heads, head_dim] slab of the cache, so
    one DMA per block serves all kv heads of the sequence.
    """
    seq = pl.program_id(0)
    num_kv_heads, group, head_dim = q_ref.shape
    block_size = k_buffer.shape[1]
    context_len = context_lens_ref[seq]
    first, end = _block_range(context_len, block_size, max_blocks_per_seq, sliding_window)
    precision = _precision(q_ref.dtype, "mosaic")

    def block_copies(logical_block, slot):
        block_id = block_tables_ref[seq * max_blocks_per_seq + logical_block]
        return (pltpu.make_async_copy(k_cache_hbm_ref.at[block_id], k_buffer.at[slot], sems.at[0, slot]),
                pltpu.make_async_copy(v_cache_hbm_ref.at[block_id], v_buffer.at[slot], sems.at[1, slot]))

    @pl.when(first < end)
    def _prefetch_first():
        for copy in block_copies(first, 0):
            copy.start()

    def body(logical_block, carry):
        slot = lax.rem(logical_block - first, 2)

        @pl.when(logical_block + 1 < end)
        def _prefetch_next():
            for copy in block_copies(logical_block + 1, 1 - slot):
                copy.start()

        for copy in block_copies(logical_block, slot):
            copy.wait()
        start = logical_block * block_size
        mask = _key_mask(start + lax.broadcasted_iota(jnp.int32, (1, block_size), 1), context_len,
                         sliding_window)  # [1, block_size]
        row_mask = _key_mask(start + lax.broadcasted_iota(jnp.int32, (block_size, 1), 0), context_len,
                             sliding_window)  # [block_size, 1]
        new_carry = []
        for h in range(num_kv_heads):
            k = k_buffer[slot, :, h, :]  # [block_size, head_dim]
            v = jnp.where(row_mask, v_buffer[slot, :, h, :], 0)  # NaN in unused slots must not reach p @ v
            scores = _scores(q_ref[h], k, sm_scale, soft_cap, precision)
            new_carry.append(_online_softmax_step(carry[h], scores, mask, lambda p: _pv(p, v, precision)))
        return tuple(new_carry)

    init = tuple(_init_state(group, head_dim) for _ in range(num_kv_heads))
    state = lax.fori_loop(first, end, body, init)
    for h in range(num_kv_heads):
        _, l, acc = state[h]
        o_ref[h] = _finish(l, acc).astype(o_ref.dtype)


def _paged_attention_tpu_call(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale, sliding_window,
                              soft_cap, interpret):
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks_per_seq = block_tables.shape[1]
    qg = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    seq_spec = pl.BlockSpec((None, *qg.shape[1:]), lambda s, *_: (s, 0, 0, 0))
    kernel = functools.partial(paged_attention_tpu_kernel, max_blocks_per_seq=max_blocks_per_seq,
                               sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    buffer = pltpu.VMEM((2, block_size, num_kv_heads, head_dim), k_cache.dtype)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_seqs,),
            in_specs=[seq_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=seq_spec,
            scratch_shapes=[buffer, buffer, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        # each program waits for every DMA it starts, so sequences are independent
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_attention_decode_tpu",
    )(block_tables.reshape(-1), context_lens, qg, k_cache, v_cache)
    return out.reshape(q.shape)


# ------------------------------------------------------------------------ public API


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "backend"))
def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, sliding_window=None,
                    soft_cap=None, interpret=None, backend=None):
    """Decode paged attention: one query per sequence against its blocks in the paged cache.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] (num_heads a multiple of num_kv_heads, one dtype for all
    three); block_tables i32[num_seqs, max_blocks_per_seq] (entries past a sequence's
    used blocks are never read); context_lens i32[num_seqs], each at most
    max_blocks_per_seq * block_size, 0 allowed (that row's output is zero). The query
    of sequence i is at position context_lens[i] - 1. sm_scale defaults to
    head_dim ** -0.5; sliding_window W keeps keys at positions > position - W; soft_cap
    c maps scores s to c * tanh(s / c). Cache slots outside a sequence's context may hold
    anything, NaN included. Returns [num_seqs, num_heads, head_dim] in q's dtype.

    backend: None (jax.default_backend()), "cpu" (the kernel in interpret mode), "gpu",
    "cuda" or "rocm" (the kernel lowered to Triton), "tpu" (the Mosaic TPU kernel).
    interpret: None means interpret exactly when JAX's default backend is the CPU; True
    runs the chosen backend's kernel in interpret mode (TPU interpret mode for "tpu").
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or positive; got {soft_cap!r}")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {_BACKENDS}; got {backend!r}")
    backend = backend or jax.default_backend()
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("Pallas kernels have no native CPU lowering: backend 'cpu' needs interpret=True (or None)")
    kwargs = dict(sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale),
                  sliding_window=sliding_window, soft_cap=soft_cap, interpret=bool(interpret))
    block_tables, context_lens = block_tables.astype(jnp.int32), context_lens.astype(jnp.int32)
    if backend == "tpu":
        return _paged_attention_tpu_call(q, k_cache, v_cache, block_tables, context_lens, **kwargs)
    # CPU runs the same kernel unpadded; "gpu" in interpret mode keeps Triton's padding,
    # so the exact program Triton gets is testable on CPU
    return _paged_attention_call(q, k_cache, v_cache, block_tables, context_lens,
                                 pad_for_triton=backend != "cpu", **kwargs)
