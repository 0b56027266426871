"""How ragged paged attention cuts a batch's query tokens into tiles, per backend.

A tile is up to `query_tile` consecutive query tokens of one sequence; the kernels loop
over tiles (and, inside a tile, over the pages it can see). The tiling is static per
launch (`_Layout`, hashable) and computed on device from query_start_loc and
context_lens (`_query_tiles`), so one compiled kernel serves every batch of its shape.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton_tuning import DEFAULT_RAGGED_TUNING, TritonTuning

# Interpret-mode tiling, measured on 2 CPU cores with SmolLM2's shapes. Sequences with at
# most _CPU_SHORT_QUERY_LEN query tokens (decode rows) get one-token tiles,
# _CPU_SHORT_TILES_PER_STEP of them per loop step: a wider tile would multiply their dot
# work for nothing, one tile per step would pay the loop overhead per row. Longer chunks
# get _CPU_QUERY_TILE-token tiles, one per step: every tile reads all its visible pages,
# so wide tiles read them fewer times (a 2048-token prefill: 107 ms with 16-token tiles,
# 69 ms with 64). An inner step gathers _CPU_CHUNK_TOKENS keys per tile, per class.
_CPU_SHORT_QUERY_LEN = 8
_CPU_SHORT_TILES_PER_STEP = 8
_CPU_QUERY_TILE = 64
_CPU_CHUNK_TOKENS = (256, 512)
# Triton tiling: TritonTuning's query_rows rows (group x tokens) per program and
# chunk_tokens keys per step (pallas_kernels/triton_tuning.py).


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static tiling of one launch (hashable; every field is a Python int, bool or tuple)."""
    query_tiles: tuple[int, ...]  # tokens per tile of each tile class
    tiles_per_step: tuple[int, ...]  # tiles one loop step of the cpu program handles, per class
    short_query_len: int  # with two classes: sequences with q_len <= this use class 0
    pages_per_chunk: tuple[int, ...]  # pages gathered per inner-loop step, per class
    group_padded: int  # query heads per KV head, padded (Triton tensors are powers of two)
    head_dim_padded: int
    single_program: bool  # one program loops over all tiles and KV heads (cpu), else a
                          # program per (tile, KV head) (gpu)


def _layout(backend: str, group: int, head_dim: int, block_size: int,
            tuning: TritonTuning = DEFAULT_RAGGED_TUNING, itemsize: int = 4) -> _Layout:
    if backend == "gpu":
        group_padded = pl.next_power_of_2(group)
        rows = max(tuning.query_rows, group_padded)
        head_dim_padded = max(16, pl.next_power_of_2(head_dim))
        return _Layout(query_tiles=(rows // group_padded,), tiles_per_step=(1,), short_query_len=0,
                       pages_per_chunk=(tuning.pages_per_chunk(block_size, head_dim_padded, itemsize),),
                       group_padded=group_padded, head_dim_padded=head_dim_padded, single_program=False)
    return _Layout(query_tiles=(1, _CPU_QUERY_TILE), tiles_per_step=(_CPU_SHORT_TILES_PER_STEP, 1),
                   short_query_len=_CPU_SHORT_QUERY_LEN,
                   pages_per_chunk=tuple(max(1, tokens // block_size) for tokens in _CPU_CHUNK_TOKENS),
                   group_padded=group, head_dim_padded=head_dim, single_program=True)


def _query_tiles(query_start_loc, context_lens, *, layout: _Layout, num_tokens: int):
    """Cut every sequence's query tokens into tiles: i32[num_classes, 4, max_tiles] (per
    tile: sequence, first q row, rows in use, position of its first token; unused tiles
    have 0 rows) and i32[num_classes] tiles in use. With two classes, sequences with
    q_len <= short_query_len go to class 0, the others to class 1. A class with tile size
    t holds at most num_tokens / t + num_seqs tiles (every sequence wastes less than one
    tile); max_tiles covers that, rounded up to whole steps. Tiles of a class that the cpu
    program takes several at a time are ordered by context length, longest first, so the
    tiles of one step need about the same number of chunks."""
    num_seqs = context_lens.shape[0]
    q_lens = jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)
    max_tiles = max(pl.cdiv(pl.cdiv(num_tokens, t) + num_seqs, n) * n
                    for t, n in zip(layout.query_tiles, layout.tiles_per_step))
    tile = jnp.arange(max_tiles)
    infos, counts = [], []
    for tile_class, (query_tile, num) in enumerate(zip(layout.query_tiles, layout.tiles_per_step)):
        if len(layout.query_tiles) == 1:
            class_q_lens = q_lens
        else:
            is_short = q_lens <= layout.short_query_len
            class_q_lens = jnp.where(is_short if tile_class == 0 else ~is_short, q_lens, 0)
        tiles = pl.cdiv(class_q_lens, query_tile)
        ends = jnp.cumsum(tiles)
        num_tiles = jnp.minimum(ends[-1], max_tiles)
        in_use = tile < num_tiles
        seq = jnp.where(in_use, jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_seqs - 1), 0)
        local = tile - (ends[seq] - tiles[seq])  # tile index inside its sequence
        # clamp against inconsistent metadata: a tile's rows stay inside the padded q
        q_start = jnp.clip(query_start_loc[seq] + local * query_tile, 0, num_tokens)
        rows = jnp.clip(jnp.minimum(query_tile, q_lens[seq] - local * query_tile), 0, num_tokens - q_start)
        first_pos = context_lens[seq] - q_lens[seq] + local * query_tile
        info = jnp.stack([seq, q_start, jnp.where(in_use, rows, 0), first_pos])
        if num > 1:
            info = info[:, jnp.argsort(jnp.where(in_use, -context_lens[seq], 1), stable=True)]
        infos.append(info)
        counts.append(num_tiles)
    return jnp.stack(infos).astype(jnp.int32), jnp.stack(counts).astype(jnp.int32)
