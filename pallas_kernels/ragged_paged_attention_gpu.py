"""Ragged paged attention's Pallas kernel for GPU (Triton), also run in interpret mode on CPU.

A unit of work is a tile of a sequence's query tokens and a KV head (its whole GQA
group): it walks the block table `pages_per_chunk` pages at a time over only the pages
the tile can see (sliding-window start to causal end), with an f32 online softmax, and
gathered K/V never exceed one chunk. One kernel body, two tilings (ragged_tiling.py):
"gpu" runs a program per (tile, KV head) lowered to Triton; "cpu" runs one program in
interpret mode that loops over every tile and all KV heads at once, because interpret
mode pays per grid step. The online-softmax step, the score computation and the mask
value are shared with the TPU variant (ragged_paged_attention_tpu.py). Called through
`ragged_paged_attention(..., backend="gpu" | "cpu")`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_tiling import _Layout, _layout, _query_tiles

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def ragged_paged_attention_kernel(
    tile_info_ref,  # i32[num_classes, 4, max_tiles]: per tile: sequence, first q row, rows in use, first position
    num_tiles_ref,  # i32[num_classes]: tiles in use per class (the rest of tile_info is padding)
    context_lens_ref,  # i32[num_seqs]
    block_tables_ref,  # i32[num_seqs, max_blocks_per_seq + max(pages_per_chunk)]
    q_ref,  # [num_tokens + max(query_tiles), num_kv_heads, group_padded, head_dim_padded]
    k_pages_ref,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages_ref,  # [num_pages, page_size, num_kv_heads, head_dim]
    o_ref,  # [num_tokens + max(query_tiles), num_kv_heads, group_padded, head_dim_padded]
    *,
    layout: _Layout,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
):
    """Attention of the query tiles this program owns, over the pages each tile can see.

    Rows are (token, group member) pairs, token-major. gpu tiling: program (tile,
    kv_head) works on [rows, head_dim] of one head. cpu tiling: one program loops over
    all tiles, a few at a time, on [tiles, kv_heads, rows, head_dim].
    """
    kwargs = dict(layout=layout, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  mask_value=mask_value)
    refs = (tile_info_ref, num_tiles_ref, context_lens_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref,
            o_ref)
    if layout.single_program:
        _attend_all_tiles(*refs, **kwargs)
    else:
        tile, kv_head = pl.program_id(0), pl.program_id(1)

        @pl.when(tile < num_tiles_ref[0])
        def _():
            _attend_tile(tile, kv_head, *refs, **kwargs)


def _visible_pages(first_pos, rows_in_use, context_len, *, page_size: int, max_pages: int,
                   sliding_window: int | None):
    """Logical pages of a tile: first (the window's start for its first token), used (the
    pages holding the context) and end (the causal bound of its last token), all capped by
    the table's width (keys past it are absent, as in the reference)."""
    hi = first_pos + rows_in_use
    if sliding_window is None:
        first = jnp.zeros_like(first_pos)
    else:
        first = jnp.maximum(first_pos - sliding_window + 1, 0) // page_size
    used = jnp.minimum(pl.cdiv(context_len, page_size), max_pages)
    end = jnp.minimum(pl.cdiv(hi, page_size), max_pages)
    return first, used, end


def _online_softmax_step(carry, s, mask, v, pv_dims, *, precision, mask_value):
    """Folds one chunk of keys into the running (max, sum, accumulator) of every row.

    s f32[..., rows, keys] (scaled, capped), mask bool broadcastable to it; v the
    chunk's values (NaN-free) and pv_dims the dot_general dims of p x v.
    """
    m_prev, l_prev, acc_prev = carry
    s = jnp.where(mask, s, mask_value)
    # a row masked so far has m == mask_value and sums exp(0) terms; its first real
    # score makes the correction exp(mask_value - m) == 0 and wipes them out
    m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    l_next = correction * l_prev + p.sum(axis=-1, keepdims=True)
    pv = lax.dot_general(p.astype(v.dtype), v, pv_dims, precision=precision, preferred_element_type=jnp.float32)
    return m_next, l_next, correction * acc_prev + pv


def _init_state(rows_shape, head_dim: int, mask_value: float):
    return (jnp.full(rows_shape + (1,), mask_value, jnp.float32), jnp.zeros(rows_shape + (1,), jnp.float32),
            jnp.zeros(rows_shape + (head_dim,), jnp.float32))


def _scores(q, k, dims, *, sm_scale, soft_cap, precision):
    s = lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32) * sm_scale
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _attend_tile(tile, kv_head, tile_info_ref, num_tiles_ref, context_lens_ref, block_tables_ref, q_ref,
                 k_pages_ref, v_pages_ref, o_ref, *, layout, sm_scale, sliding_window, soft_cap, mask_value):
    """gpu tiling: one query tile, one KV head, 2-D [rows, head_dim_padded] throughout."""
    del num_tiles_ref
    _, page_size, _, head_dim = k_pages_ref.shape
    (query_tile,), (pages_per_chunk,) = layout.query_tiles, layout.pages_per_chunk
    group, dim = layout.group_padded, layout.head_dim_padded
    num_rows, chunk_tokens = query_tile * group, pages_per_chunk * page_size
    seq, q_start = tile_info_ref[0, 0, tile], tile_info_ref[0, 1, tile]
    rows_in_use, first_pos = tile_info_ref[0, 2, tile], tile_info_ref[0, 3, tile]
    context_len = context_lens_ref[seq]
    # HIGHEST: f32 dots in full f32 (Triton's default is TF32), and no TF32 flag on bf16
    # dots; both accumulate in f32
    precision = lax.Precision.HIGHEST
    first, used, end = _visible_pages(first_pos, rows_in_use, context_len, page_size=page_size,
                                      max_pages=block_tables_ref.shape[1] - pages_per_chunk,
                                      sliding_window=sliding_window)
    q = q_ref[pl.ds(q_start, query_tile), kv_head].reshape(num_rows, dim)
    q_pos = first_pos + jnp.arange(num_rows)[:, None] // group  # [R, 1] position of each row's token
    # the head_dim padding reads column head_dim - 1 again; q is zero there, and the
    # output columns it feeds are cut off by the wrapper
    dim_index = jnp.minimum(jnp.arange(dim), head_dim - 1)[None, None, :]
    slot_index = jnp.arange(page_size)[None, :, None]

    def chunk_body(chunk, carry):
        page0 = first + chunk * pages_per_chunk
        page_index = page0 + jnp.arange(pages_per_chunk)
        # table entries past the context may be anything: read the null page instead
        pages = jnp.where(page_index < used, block_tables_ref[seq, pl.ds(page0, pages_per_chunk)], 0)
        k, v = (pages_ref[pages[:, None, None], slot_index, kv_head, dim_index].reshape(chunk_tokens, dim)
                for pages_ref in (k_pages_ref, v_pages_ref))
        k_pos = page0 * page_size + jnp.arange(chunk_tokens)  # [S]
        in_context = k_pos < context_len
        # slots past the context may hold NaN: zero them in V (scores are masked)
        v = jnp.where(in_context[:, None], v, jnp.zeros_like(v))
        s = _scores(q, k, (((1,), (1,)), ((), ())), sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
        mask = in_context[None, :] & (k_pos[None, :] <= q_pos)  # [R, S]
        if sliding_window is not None:
            mask = mask & (k_pos[None, :] > q_pos - sliding_window)
        return _online_softmax_step(carry, s, mask, v, (((1,), (0,)), ((), ())), precision=precision,
                                    mask_value=mask_value)

    num_chunks = pl.cdiv(end - first, pages_per_chunk)
    _, l, acc = lax.fori_loop(0, num_chunks, chunk_body, _init_state((num_rows,), dim, mask_value))
    out = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype).reshape(query_tile, group, dim)
    # rows past the sequence belong to the next one, which another program writes
    row_ok = jnp.arange(query_tile)[:, None, None] < rows_in_use
    plgpu.store(o_ref.at[pl.ds(q_start, query_tile), kv_head], out, mask=jnp.broadcast_to(row_ok, out.shape))


def _attend_all_tiles(tile_info_ref, num_tiles_ref, context_lens_ref, block_tables_ref, q_ref, k_pages_ref,
                      v_pages_ref, o_ref, *, layout, sm_scale, sliding_window, soft_cap, mask_value):
    """cpu tiling: every tile of every class, tiles_per_step tiles and all KV heads per
    loop step: [tiles, kv_heads, rows, head_dim] throughout.

    Interpret mode discharges ref indexing with index arrays into gathers of single
    elements, so the whole arrays are read once as values and indexed as values: then a
    gather moves whole pages (or q rows), and the output is one in-place scatter per step.
    """
    num_slots, num_kv_heads, group, head_dim = q_ref.shape  # num_tokens + the largest tile
    page_size = k_pages_ref.shape[1]
    max_pages = block_tables_ref.shape[1] - max(layout.pages_per_chunk)
    k_pages, v_pages, q_all = k_pages_ref[...], v_pages_ref[...], q_ref[...]
    tables, context_lens = block_tables_ref[...], context_lens_ref[...]
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    qk_dims = (((3,), (3,)), ((0, 1), (0, 2)))  # [N, H, R, D] x [N, S, H, D] -> [N, H, R, S]
    pv_dims = (((3,), (1,)), ((0, 1), (0, 2)))  # [N, H, R, S] x [N, S, H, D] -> [N, H, R, D]

    for tile_class, query_tile in enumerate(layout.query_tiles):
        num, pages_per_chunk = layout.tiles_per_step[tile_class], layout.pages_per_chunk[tile_class]
        num_rows, chunk_tokens = query_tile * group, pages_per_chunk * page_size

        def step(step_index, carry, tile_class=tile_class, query_tile=query_tile, num=num, num_rows=num_rows,
                 pages_per_chunk=pages_per_chunk, chunk_tokens=chunk_tokens):
            seq, q_start, rows_in_use, first_pos = (
                tile_info_ref[tile_class, i, pl.ds(step_index * num, num)] for i in range(4))  # i32[N] each
            context_len = context_lens[seq]
            first, used, end = _visible_pages(first_pos, rows_in_use, context_len, page_size=page_size,
                                              max_pages=max_pages, sliding_window=sliding_window)
            token = q_start[:, None] + jnp.arange(query_tile)  # [N, TQ]
            q = q_all[token].transpose(0, 2, 1, 3, 4).reshape(num, num_kv_heads, num_rows, head_dim)
            q_pos = (first_pos[:, None] + jnp.arange(num_rows) // group)[:, None, :, None]  # [N, 1, R, 1]

            def chunk_body(chunk, carry):
                page_index = first[:, None] + chunk * pages_per_chunk + jnp.arange(pages_per_chunk)  # [N, P]
                # table entries past the context may be anything: read the null page instead
                # (a tile that needs fewer chunks than the step's longest reads past the
                # table here; the gather clamps and the entry is replaced too)
                pages = jnp.where(page_index < used[:, None], tables[seq[:, None], page_index], 0)
                k, v = (cache[pages].reshape(num, chunk_tokens, num_kv_heads, head_dim)
                        for cache in (k_pages, v_pages))
                k_pos = (first * page_size + chunk * chunk_tokens)[:, None] + jnp.arange(chunk_tokens)  # [N, S]
                in_context = k_pos < context_len[:, None]
                # slots past the context may hold NaN: zero them in V (scores are masked)
                v = jnp.where(in_context[:, :, None, None], v, jnp.zeros_like(v))
                s = _scores(q, k, qk_dims, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
                k_pos = k_pos[:, None, None, :]
                mask = in_context[:, None, None, :] & (k_pos <= q_pos)  # [N, 1, R, S]
                if sliding_window is not None:
                    mask = mask & (k_pos > q_pos - sliding_window)
                return _online_softmax_step(carry, s, mask, v, pv_dims, precision=precision, mask_value=mask_value)

            # the step runs as many chunks as its longest tile needs; masks cover the rest
            num_chunks = jnp.max(jnp.where(rows_in_use > 0, pl.cdiv(end - first, pages_per_chunk), 0))
            _, l, acc = lax.fori_loop(0, num_chunks, chunk_body,
                                      _init_state((num, num_kv_heads, num_rows), head_dim, mask_value))
            out = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)
            out = out.reshape(num, num_kv_heads, query_tile, group, head_dim).transpose(0, 2, 1, 3, 4)
            # rows past a tile's sequence belong to another tile: drop them
            token = jnp.where(jnp.arange(query_tile) < rows_in_use[:, None], token, num_slots)
            o_ref[...] = o_ref[...].at[token].set(out, mode="drop")
            return carry

        lax.fori_loop(0, pl.cdiv(num_tiles_ref[tile_class], num), step, 0)


def ragged_paged_attention_gpu_call(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                                    backend, sm_scale, sliding_window, soft_cap, interpret, tuning):
    """pallas_call of `ragged_paged_attention_kernel` with backend's tiling ("gpu" or "cpu";
    `tuning`, a TritonTuning, shapes the gpu one), inputs as `ragged_paged_attention`
    checked and cast them."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    layout = _layout(backend, group, head_dim, block_size, tuning, jnp.dtype(q.dtype).itemsize)
    tile_info, num_tiles = _query_tiles(query_start_loc, context_lens, layout=layout, num_tokens=num_tokens)
    # pad: a tile's rows and a chunk's pages_per_chunk table entries stay in bounds
    tables = jnp.pad(block_tables, ((0, 0), (0, max(layout.pages_per_chunk))))
    q_tiled = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                      ((0, max(layout.query_tiles)), (0, 0), (0, layout.group_padded - group),
                       (0, layout.head_dim_padded - head_dim)))
    kernel = functools.partial(ragged_paged_attention_kernel, layout=layout, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, mask_value=DEFAULT_MASK_VALUE)
    if layout.single_program:
        grid, compiler_params = (1,), None
    else:
        grid = (tile_info.shape[-1], num_kv_heads)
        compiler_params = plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=jax.ShapeDtypeStruct(q_tiled.shape, q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="ragged_paged_attention",
    )(tile_info, num_tiles, context_lens, tables, q_tiled, k_cache, v_cache)
    out = out[:num_tokens, :, :group, :head_dim].reshape(num_tokens, num_heads, head_dim)
    is_query = jnp.arange(num_tokens) < query_start_loc[num_seqs]  # the rest is padding: zeros
    return jnp.where(is_query[:, None, None], out, jnp.zeros_like(out))
