"""Decode paged attention's Pallas kernel for TPU (Mosaic).

One program per sequence: block tables and context lengths are scalar-prefetched into
SMEM, the cache stays in HBM (`pl.ANY`), and each block's K/V is copied into a
double-buffered VMEM scratch by async DMA while the previous block computes. Shares the
online-softmax math with the GPU kernel (paged_attention_gpu.py); called through
`paged_attention(..., backend="tpu")`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention_gpu import (
    _block_range,
    _finish,
    _init_state,
    _key_mask,
    _online_softmax_step,
    _precision,
    _pv,
    _scores,
)


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


def paged_attention_tpu_call(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale, sliding_window,
                             soft_cap, interpret):
    """pallas_call of `paged_attention_tpu_kernel`, one program per sequence, inputs as
    `paged_attention` checked and cast them; interpret uses TPU interpret mode."""
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
