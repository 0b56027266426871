"""Ragged paged attention on TPU (Mosaic): the TPU variant of ragged_paged_attention.py.

Tiles and block tables are scalar-prefetched into SMEM, the cache stays in HBM
(`pl.ANY`), each page's K/V is copied into a double-buffered VMEM scratch by async DMA
while the previous page computes, and each tile's output is written back token by token
(programs never write the same rows). Shares the tiling and the online-softmax step with
the CPU/GPU kernel (ragged_paged_attention_gpu.py); called through
`ragged_paged_attention(..., backend="tpu")`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention_gpu import DEFAULT_MASK_VALUE, _init_state, _online_softmax_step, _scores
from pallas_kernels.ragged_tiling import _Layout, _query_tiles

_TPU_QUERY_TILE = 8  # tokens per tile


def ragged_paged_attention_tpu_kernel(
    # scalar prefetch (SMEM)
    tile_info_ref,  # i32[4 * max_tiles]: [4, max_tiles] flattened, as in ragged_paged_attention_kernel
    num_tiles_ref,  # i32[1]
    context_lens_ref,  # i32[num_seqs]
    block_tables_ref,  # i32[num_seqs * max_blocks_per_seq] (flattened)
    # inputs, left in HBM (pl.ANY) and copied by hand
    q_hbm_ref,  # [num_tokens + query_tile, num_kv_heads, group_padded, head_dim]
    k_pages_hbm_ref,  # [num_pages, page_size, num_kv_heads, head_dim] (never copied whole)
    v_pages_hbm_ref,  # [num_pages, page_size, num_kv_heads, head_dim]
    # output (HBM)
    o_hbm_ref,  # [num_tokens + query_tile, num_kv_heads, group_padded, head_dim]
    # scratch
    q_buffer,  # VMEM [query_tile, num_kv_heads, group_padded, head_dim]
    o_buffer,  # VMEM [query_tile, num_kv_heads, group_padded, head_dim]
    k_buffer,  # VMEM [2, page_size, num_kv_heads, head_dim]: double buffer
    v_buffer,  # VMEM [2, page_size, num_kv_heads, head_dim]
    page_sems,  # DMA semaphores [2 (k, v), 2 (buffer slot)]
    row_sems,  # DMA semaphores [query_tile + 1]: one per output token, and q's
    *,
    max_tiles: int,
    max_blocks_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
):
    """Program (query tile): DMA page i + 1 while computing page i, every KV head per page.

    A page is one contiguous [page_size, num_kv_heads, head_dim] slab of the cache, so one
    DMA per page serves all heads. The tile's tokens come in by one DMA; its output leaves
    token by token, only the tokens of its own sequence, so programs never write the same
    rows and may run in any order. Every copy moves whole leading-dim slices, and the
    group is padded to whole sublane tiles, so [tokens, group, head_dim] folds into
    [rows, head_dim] without a relayout.
    """
    tile = pl.program_id(0)
    query_tile, num_kv_heads, group, head_dim = q_buffer.shape
    num_rows = query_tile * group
    page_size = k_buffer.shape[1]
    precision = lax.Precision.HIGHEST if q_buffer.dtype == jnp.float32 else lax.Precision.DEFAULT

    @pl.when(tile < num_tiles_ref[0])
    def _():
        seq, q_start = tile_info_ref[tile], tile_info_ref[max_tiles + tile]
        rows_in_use, first_pos = tile_info_ref[2 * max_tiles + tile], tile_info_ref[3 * max_tiles + tile]
        context_len = context_lens_ref[seq]
        q_copy = pltpu.make_async_copy(q_hbm_ref.at[pl.ds(q_start, query_tile)], q_buffer, row_sems.at[query_tile])
        q_copy.start()
        # pages [first, end): causal up to the tile's last token, the window from its
        # first; lax.div, not //, whose sign fix-up Mosaic lowers only for a known TPU
        hi = jnp.minimum(first_pos + rows_in_use, context_len)
        lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        first = lax.div(lo, page_size)
        end = jnp.minimum(lax.div(hi + page_size - 1, page_size), max_blocks_per_seq)

        def page_copies(logical_page, slot):
            page = block_tables_ref[seq * max_blocks_per_seq + logical_page]
            return (pltpu.make_async_copy(k_pages_hbm_ref.at[page], k_buffer.at[slot], page_sems.at[0, slot]),
                    pltpu.make_async_copy(v_pages_hbm_ref.at[page], v_buffer.at[slot], page_sems.at[1, slot]))

        @pl.when(first < end)
        def _prefetch_first():
            for copy in page_copies(first, 0):
                copy.start()

        q_copy.wait()
        # the token of each row: row // group, a shift (group is a power of two)
        row_token = lax.shift_right_logical(lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0),
                                            group.bit_length() - 1)
        q_pos = first_pos + row_token  # [R, 1]
        q_heads = [q_buffer[:, h].reshape(num_rows, head_dim) for h in range(num_kv_heads)]

        def body(logical_page, carry):
            slot = lax.rem(logical_page - first, 2)

            @pl.when(logical_page + 1 < end)
            def _prefetch_next():
                for copy in page_copies(logical_page + 1, 1 - slot):
                    copy.start()

            for copy in page_copies(logical_page, slot):
                copy.wait()
            start = logical_page * page_size
            k_pos = start + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            mask = (k_pos < context_len) & (k_pos <= q_pos)  # [R, page_size]
            if sliding_window is not None:
                mask = mask & (k_pos > q_pos - sliding_window)
            # slots past the context may hold NaN, and 0 * NaN is NaN: zero them in V
            slot_in_context = start + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0) < context_len
            new_carry = []
            for h in range(num_kv_heads):
                k = k_buffer[slot, :, h, :]  # [page_size, head_dim]
                v = jnp.where(slot_in_context, v_buffer[slot, :, h, :], 0)
                s = _scores(q_heads[h], k, (((1,), (1,)), ((), ())), sm_scale=sm_scale, soft_cap=soft_cap,
                            precision=precision)
                new_carry.append(_online_softmax_step(carry[h], s, mask, v, (((1,), (0,)), ((), ())),
                                                      precision=precision, mask_value=mask_value))
            return tuple(new_carry)

        init = tuple(_init_state((num_rows,), head_dim, mask_value) for _ in range(num_kv_heads))
        state = lax.fori_loop(first, end, body, init)
        for h in range(num_kv_heads):
            _, l, acc = state[h]
            out = (acc / jnp.where(l > 0, l, 1.0)).astype(o_buffer.dtype)
            o_buffer[:, h] = out.reshape(query_tile, group, head_dim)

        def row_copy(r):
            return pltpu.make_async_copy(o_buffer.at[r], o_hbm_ref.at[q_start + r], row_sems.at[r])

        for r in range(query_tile):  # tokens past rows_in_use belong to another sequence
            pl.when(r < rows_in_use)(lambda r=r: row_copy(r).start())
        for r in range(query_tile):
            pl.when(r < rows_in_use)(lambda r=r: row_copy(r).wait())


def ragged_paged_attention_tpu_call(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                                     sm_scale, sliding_window, soft_cap, interpret):
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    # a whole number of sublane tiles (8 rows of 32 bits: 16 bf16 rows), a power of two
    group_padded = pl.next_power_of_2(max(group, 32 // q.dtype.itemsize))
    query_tile = _TPU_QUERY_TILE
    layout = _Layout(query_tiles=(query_tile,), tiles_per_step=(1,), short_query_len=0, pages_per_chunk=(1,),
                     group_padded=group_padded, head_dim_padded=head_dim, single_program=False)
    tile_info, num_tiles = _query_tiles(query_start_loc, context_lens, layout=layout, num_tokens=num_tokens)
    max_tiles = tile_info.shape[-1]
    q_tiled = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                      ((0, query_tile), (0, 0), (0, group_padded - group), (0, 0)))
    kernel = functools.partial(
        ragged_paged_attention_tpu_kernel, max_tiles=max_tiles, max_blocks_per_seq=max_blocks_per_seq,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=DEFAULT_MASK_VALUE)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    page_buffer = pltpu.VMEM((2, page_size, num_kv_heads, head_dim), k_cache.dtype)
    tile_buffer = pltpu.VMEM((query_tile, num_kv_heads, group_padded, head_dim), q.dtype)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(max_tiles,),
            in_specs=[any_spec, any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[tile_buffer, tile_buffer, page_buffer, page_buffer, pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.SemaphoreType.DMA((query_tile + 1,))],
        ),
        out_shape=jax.ShapeDtypeStruct(q_tiled.shape, q.dtype),
        # every program waits for each DMA it starts and writes only its own tokens
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(tile_info.reshape(-1), num_tiles, context_lens, block_tables.reshape(-1), q_tiled, k_cache, v_cache)
    out = out[:num_tokens, :, :group].reshape(num_tokens, num_heads, head_dim)
    is_query = jnp.arange(num_tokens) < query_start_loc[num_seqs]  # the rest is padding: zeros
    return jnp.where(is_query[:, None, None], out, jnp.zeros_like(out))


