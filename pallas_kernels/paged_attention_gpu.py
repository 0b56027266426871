"""Decode paged attention's Pallas kernel for GPU (Triton), also run in interpret mode on CPU.

One program per (sequence, kv head) computes the whole GQA group of query heads with a
`lax.fori_loop` over the sequence's used blocks only, reading K/V in place through the
block table, `pages_per_chunk` blocks per step (TritonTuning.chunk_tokens on GPU: more
keys per step keep more loads in flight; one block per step on CPU, where interpret mode
reads a single block as a view but a gathered chunk element by element). Triton wants
power-of-two tensors and dots of at least 16 per dimension, so the wrapper pads the group
and head_dim for it; the CPU path runs the same kernel unpadded. The online-softmax math
at the top is shared with the TPU variant (paged_attention_tpu.py). Called through
`paged_attention(..., backend="gpu" | "cpu")`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.triton_tuning import default_decode_tuning

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
        block_tables_ref,  # i32[num_seqs, max_blocks_per_seq + pages_per_chunk - 1] (whole array)
        context_lens_ref,  # i32[num_seqs] (whole array)
        q_ref,  # [group_rows, head_dim_padded]: the query heads of one kv head of one sequence
        k_cache_ref,  # [num_blocks, block_size, num_kv_heads, head_dim(_padded)] (whole cache)
        v_cache_ref,  # [num_blocks, block_size, num_kv_heads, head_dim(_padded)]
        o_ref,  # [group_rows, head_dim_padded]: q's dtype; f32 and this split's share with num_splits > 1
        *split_refs,  # num_splits > 1: m_ref, l_ref f32[group_rows, 1], this split's running max and sum
        head_dim: int, max_blocks_per_seq: int, pages_per_chunk: int, num_splits: int, sm_scale: float,
        sliding_window: int | None, soft_cap: float | None):
    """Program (sequence, kv head, split): online softmax over the split's share of the
    sequence's used blocks, pages_per_chunk blocks per loop step.

    Splits: the used blocks are cut into num_splits runs of whole chunks, one program
    each, so that a batch of few sequences still fills the GPU; each writes its
    normalized output with its (max, sum), and the wrapper merges them (log-sum-exp).
    For Triton the wrapper pads group_rows and head_dim to powers of two >= 16: padded
    query rows are zero and dropped afterwards. One block per step reads it as a view
    (padded head dims masked on load); several per step gather them through their table
    entries (padded head dims read column head_dim - 1 again: q is zero there, and the
    output columns they feed are cut off), table entries past the used blocks replaced by
    the null block.
    """
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group_rows, head_dim_padded = q_ref.shape
    block_size = k_cache_ref.shape[1]
    chunk = pages_per_chunk * block_size
    context_len = context_lens_ref[seq]
    first, end = _block_range(context_len, block_size, max_blocks_per_seq, sliding_window)
    num_chunks = lax.div(end - first + (pages_per_chunk - 1), pages_per_chunk)
    per_split = lax.div(num_chunks + (num_splits - 1), num_splits)
    first_chunk = split * per_split  # this split's chunks: [first_chunk, first_chunk + num_steps)
    num_steps = jnp.clip(num_chunks - first_chunk, 0, per_split)

    if pages_per_chunk == 1:
        dim_mask = None
        if head_dim != head_dim_padded:
            dim_mask = lax.broadcasted_iota(jnp.int32, (block_size, head_dim_padded), 1) < head_dim

        def load_chunk(cache_ref, page0):  # [block_size, head_dim_padded], read in place
            view = cache_ref.at[block_tables_ref[seq, page0], :, kv_head, :]
            return view[...] if dim_mask is None else plgpu.load(view, mask=dim_mask, other=0)
    else:
        slot_index = jnp.arange(block_size)[None, :, None]
        # a padded head_dim reads column head_dim - 1 again; an unpadded one (a power of
        # two, e.g. 64 or 128) indexes with the bare range, which Triton sees as contiguous
        # and loads 16 bytes at a time (behind a min() it loads element by element)
        dim_index = jnp.arange(head_dim_padded)
        if head_dim != head_dim_padded:
            dim_index = jnp.minimum(dim_index, head_dim - 1)
        dim_index = dim_index[None, None, :]

        def load_chunk(cache_ref, page0):  # [chunk, head_dim_padded], gathered through the table
            page_index = page0 + jnp.arange(pages_per_chunk)
            pages = jnp.where(page_index < end, block_tables_ref[seq, pl.ds(page0, pages_per_chunk)], 0)
            return cache_ref[pages[:, None, None], slot_index, kv_head, dim_index].reshape(chunk, head_dim_padded)

    q = q_ref[...]
    # Triton's dot needs >= 16 keys; a smaller chunk is reduced by hand (same math)
    use_dot = chunk >= _TRITON_MIN_DIM

    def body(step, carry):
        page0 = first + (first_chunk + step) * pages_per_chunk
        k = load_chunk(k_cache_ref, page0)
        v = load_chunk(v_cache_ref, page0)
        start = page0 * block_size
        mask = _key_mask(start + lax.broadcasted_iota(jnp.int32, (1, chunk), 1), context_len,
                         sliding_window)  # [1, chunk], for the scores
        row_mask = _key_mask(start + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0), context_len,
                             sliding_window)  # [chunk, 1], for the values
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

    m, l, acc = lax.fori_loop(0, num_steps, body, _init_state(group_rows, head_dim_padded))
    o_ref[...] = _finish(l, acc).astype(o_ref.dtype)
    if split_refs:
        m_ref, l_ref = split_refs
        m_ref[...] = m
        l_ref[...] = l


def _merge_splits(o, m, l):
    """One output from the splits' normalized outputs o f32[..., splits, rows, dim] and
    their running max m and sum l f32[..., splits, rows, 1] (empty splits: m -inf, l 0)."""
    m_max = jnp.max(m, axis=-3, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    weight = jnp.where(l > 0, jnp.exp(m - m_safe) * l, 0.0)
    total = jnp.sum(weight, axis=-3)
    return jnp.sum(weight * o, axis=-3) / jnp.where(total > 0, total, 1.0)


def paged_attention_gpu_call(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale, sliding_window,
                             soft_cap, interpret, pad_for_triton, tuning):
    """pallas_call of `paged_attention_kernel` over the (sequence, kv head, split) grid,
    inputs as `paged_attention` checked and cast them; pad_for_triton pads group and
    head_dim (and caps the tuning's chunk to Triton's shared memory); `tuning`, a
    TritonTuning, sets the chunk, the splits and the launch (None: the default for the
    padded head_dim and the dtype, triton_tuning.default_decode_tuning)."""
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks_per_seq = block_tables.shape[1]
    group = num_heads // num_kv_heads
    group_rows, head_dim_padded = group, head_dim
    if pad_for_triton:
        group_rows = max(_TRITON_MIN_DIM, pl.next_power_of_2(group))
        head_dim_padded = max(_TRITON_MIN_DIM, pl.next_power_of_2(head_dim))
        tuning = tuning or default_decode_tuning(head_dim_padded, jnp.dtype(q.dtype).itemsize)
        pages_per_chunk = tuning.pages_per_chunk(block_size, head_dim_padded, jnp.dtype(q.dtype).itemsize)
    else:
        tuning = tuning or default_decode_tuning(head_dim, jnp.dtype(q.dtype).itemsize)
        pages_per_chunk = tuning.pages_per_chunk(block_size)
    num_splits = tuning.num_splits(num_seqs, num_kv_heads, -(-max_blocks_per_seq // pages_per_chunk))
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_rows - group), (0, head_dim_padded - head_dim)))
    # a chunk's table entries stay in bounds (the ones past the used blocks are not used)
    tables = jnp.pad(block_tables, ((0, 0), (0, pages_per_chunk - 1)))
    whole = lambda shape: pl.BlockSpec(shape, lambda s, h, k: (0,) * len(shape))
    # the cache's block is the whole cache; the kernel indexes blocks through the table.
    # Read as views, head_dim is rounded up for Triton (a padded block whose extra columns
    # the kernel masks); gathered, the kernel never indexes past head_dim
    cache_dim = head_dim_padded if pages_per_chunk == 1 else head_dim
    cache_spec = whole((num_blocks, block_size, num_kv_heads, cache_dim))
    q_spec = pl.BlockSpec((None, None, group_rows, head_dim_padded), lambda s, h, k: (s, h, 0, 0))
    if num_splits == 1:
        out_specs = pl.BlockSpec((None, None, group_rows, head_dim_padded), lambda s, h, k: (s, h, 0, 0))
        out_shape = jax.ShapeDtypeStruct(qg.shape, q.dtype)
    else:
        split_spec = lambda cols: pl.BlockSpec((None, None, None, group_rows, cols), lambda s, h, k: (s, h, k, 0, 0))
        split_shape = lambda cols: jax.ShapeDtypeStruct((num_seqs, num_kv_heads, num_splits, group_rows, cols),
                                                        jnp.float32)
        out_specs = [split_spec(head_dim_padded), split_spec(1), split_spec(1)]
        out_shape = [split_shape(head_dim_padded), split_shape(1), split_shape(1)]
    kernel = functools.partial(paged_attention_kernel, head_dim=head_dim, max_blocks_per_seq=max_blocks_per_seq,
                               pages_per_chunk=pages_per_chunk, num_splits=num_splits, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap)
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[whole(tables.shape), whole(context_lens.shape), q_spec, cache_spec, cache_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        name="paged_attention_decode",
    )(tables, context_lens, qg, k_cache, v_cache)
    if num_splits > 1:
        out = _merge_splits(*out).astype(q.dtype)
    return out[:, :, :group, :head_dim].reshape(num_seqs, num_heads, head_dim)
