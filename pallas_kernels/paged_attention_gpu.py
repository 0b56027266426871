"""Decode paged attention's Pallas kernel for GPU (Triton), also run in interpret mode on CPU.

One program per (sequence, kv head) computes the whole GQA group of query heads with a
`lax.fori_loop` over the sequence's used blocks only, reading each block's K/V in place
through the block table. Triton wants power-of-two tensors and dots of at least 16 per
dimension, so the wrapper pads the group and head_dim for it; the CPU path runs the same
kernel unpadded. The online-softmax math at the top is shared with the TPU variant
(paged_attention_tpu.py). Called through `paged_attention(..., backend="gpu" | "cpu")`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Triton's tensors need power-of-two sizes and its dot needs each dimension >= 16.
_TRITON_MIN_DIM = 16


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


def paged_attention_gpu_call(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale, sliding_window,
                             soft_cap, interpret, pad_for_triton):
    """pallas_call of `paged_attention_kernel` over the (sequence, kv head) grid, inputs as
    `paged_attention` checked and cast them; pad_for_triton pads group and head_dim."""
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
