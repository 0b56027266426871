"""Ragged paged attention: a mixed batch of prefill chunks and decode tokens.

Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) of the flat
token axis: the last q_len_i of its context_lens[i] tokens (a prefill chunk, or one
decode token). Its keys and values live in the paged cache, block b of the sequence at
physical block block_tables[i, b]. Attention is causal within the sequence.

File layout (DESIGN.md, "Kernels"):
  * `ragged_paged_attention_reference`: pure jnp (gather each token's blocks through the
    block table, dense masked softmax), the ground truth and the engine's "reference"
    attention backend.
  * `ragged_paged_attention_kernel`: the Pallas kernel for CPU (interpret mode) and GPU
    (Triton). A unit of work is a tile of a sequence's query tokens and a KV head (its
    whole GQA group); it walks the table `pages_per_chunk` pages at a time over only the
    pages the tile can see (sliding-window start to causal end), with an f32 online
    softmax; gathered K/V never exceed one chunk. Two tilings of the same body:
      - "gpu" (Triton): a program per (tile, KV head); group and head_dim padded to
        powers of two, at least 16 rows per dot, masked stores of the tile's rows.
      - "cpu" (interpret mode): one program that loops over every tile and does all KV
        heads at once: interpret mode pays per grid step (32 decode rows at context 512:
        the gpu tiling 19 ms, this program 5.7 ms, the jnp reference 6.3 ms).
  * `ragged_paged_attention_tpu.py` (its own file): Mosaic TPU: tiles and block tables
    scalar-prefetched into SMEM, the cache left in HBM (`pl.ANY`), each page's K/V
    copied into a double-buffered VMEM scratch by async DMA while the previous page
    computes, the tile's output written back token by token.

Every variant masks keys past context_len out of the scores *and* zeroes them in the
values, and never dereferences table entries past the context (unused slots may hold
NaN). Padding tokens get zeros; a sequence with q_len 0 owns no token and costs nothing.
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


def _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_start_loc):
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [num_tokens, num_heads, head_dim] and k/v caches "
                         f"[num_blocks, block_size, num_kv_heads, head_dim] of one shape; got q {q.shape}, "
                         f"k_cache {k_cache.shape}, v_cache {v_cache.shape}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"head_dim {head_dim} vs cache {k_cache.shape[3]}, num_heads {num_heads} must be a "
                         f"multiple of num_kv_heads {num_kv_heads}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"block_tables {block_tables.shape} needs context_lens [{num_seqs}] and "
                         f"query_start_loc [{num_seqs + 1}]; got {context_lens.shape}, {query_start_loc.shape}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens),
                      ("query_start_loc", query_start_loc)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {arr.dtype}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                                     sm_scale=None, sliding_window=None, soft_cap=None):
    """Reference ragged paged attention.

    q [num_tokens, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables i32[num_seqs, max_blocks_per_seq];
    context_lens i32[num_seqs] (tokens in the cache after this step's writes);
    query_start_loc i32[num_seqs + 1] (non-decreasing; q_len_i <= context_lens[i]).
    Tokens past query_start_loc[num_seqs] are padding: their output is zero.
    sm_scale defaults to head_dim ** -0.5; sliding_window W keeps keys with
    position > query position - W; soft_cap c maps scores s to c * tanh(s / c).
    Returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale

    token = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], token, side="right")  # the sequence owning each token
    valid = token < query_start_loc[num_seqs]
    seq = jnp.minimum(seq, num_seqs - 1)
    # position of each query token inside its sequence: the q_len new tokens end the context
    position = context_lens[seq] - (query_start_loc[seq + 1] - token)

    tables = block_tables[seq]  # [T, max_blocks]
    keys = k_cache[tables].reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[tables].reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(max_blocks * block_size)[None, :]
    # slots past the context (table padding, the last block's tail) may hold anything, NaN
    # included: mask them out of the scores and zero them in the values
    in_context = key_pos < context_lens[seq][:, None]
    values = jnp.where(in_context[:, :, None, None], values, 0)
    mask = (key_pos <= position[:, None]) & valid[:, None] & in_context
    if sliding_window is not None:
        mask &= key_pos > position[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)  # fully masked rows (padding) give zeros
    out = jnp.einsum("tkgs,tskd->tkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BACKENDS = ("cpu", "gpu", "cuda", "rocm", "tpu")
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


def _ragged_paged_attention_call(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                                 backend, sm_scale, sliding_window, soft_cap, interpret):
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    layout = _layout(backend, group, head_dim, block_size)
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
        grid, compiler_params = (tile_info.shape[-1], num_kv_heads), plgpu.CompilerParams(num_warps=4, num_stages=2)
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


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "backend"))
def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                           sm_scale=None, sliding_window=None, soft_cap=None, interpret=None, backend=None):
    """Ragged paged attention, the Pallas kernel (same contract as the reference).

    q [num_tokens, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] of q's dtype (num_heads a multiple of num_kv_heads);
    block_tables i32[num_seqs, max_blocks_per_seq]; context_lens i32[num_seqs] (tokens in
    the cache after this step's writes, at most max_blocks_per_seq * block_size);
    query_start_loc i32[num_seqs + 1] (non-decreasing, query_start_loc[num_seqs] <=
    num_tokens, q_len_i = query_start_loc[i+1] - query_start_loc[i] <= context_lens[i]).
    Sequence i's tokens are the last q_len_i of its context and attend causally; rows
    with q_len 0 are allowed; tokens past query_start_loc[num_seqs] are padding and give
    zeros. Table entries past a sequence's context are never read, and cache slots
    outside it may hold anything, NaN included. sm_scale defaults to head_dim ** -0.5;
    sliding_window W keeps keys with position > query position - W; soft_cap c maps
    scores s to c * tanh(s / c). Returns [num_tokens, num_heads, head_dim] in q's dtype.

    backend: None (jax.default_backend()), "cpu" (the single-program tiling, interpret
    mode only), "gpu", "cuda" or "rocm" (the Triton tiling: a program per query tile and
    KV head; needs a power-of-two block_size), "tpu" (the Mosaic kernel). interpret: None
    means interpret exactly when JAX's default backend is the CPU; True runs the chosen
    backend's kernel in interpret mode (TPU interpret mode for "tpu").
    """
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q and the caches must be floating point; got {q.dtype}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or positive; got {soft_cap!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}; got {backend!r}")
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend or jax.default_backend(), backend or jax.default_backend())
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("Pallas kernels have no native CPU lowering: backend 'cpu' needs interpret=True (or None)")
    block_size = k_cache.shape[1]
    if backend == "gpu" and block_size & (block_size - 1):
        raise ValueError(f"the gpu tiling needs a power-of-two block_size; got {block_size}")
    kwargs = dict(sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale),
                  sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
                  interpret=bool(interpret))
    args = (q, k_cache, v_cache, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
            query_start_loc.astype(jnp.int32))
    if backend == "tpu":
        # imported here: the TPU module builds on this one's helpers
        from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu_call
        return ragged_paged_attention_tpu_call(*args, **kwargs)
    return _ragged_paged_attention_call(*args, backend=backend, **kwargs)
