"""The model's attention_fn on the paged KV cache: write the new K/V at their slots, then
attend through the block tables with the kernels the platform chose.

The cache layout is paged_jax/worker/kv_cache.py's: {"k", "v"}, each
[num_layers, num_blocks, block_size, num_kv_heads, head_dim]. A token at position p of a
sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`;
padded tokens carry slot `num_blocks * block_size`, which the scatter drops.

Which write and which attention kernel run is an argument (`AttentionKernels`), never a
lookup here: the portable ones are built by `portable_kernels` (the Pallas kernels, their
jnp reference, the XLA chunked loop: pallas_kernels/, chunked_attention.py), and the
platform layer (paged_jax/platform/) adds its own (the CPU's C++ kernels), so this file
runs unchanged on every device.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax.numpy as jnp

from paged_jax.attention.chunked_attention import chunked_decode_attention
from paged_jax.attention.decode_dispatch import decode_or_ragged
from pallas_kernels.paged_attention import paged_attention as decode_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

PORTABLE_BACKENDS = ("pallas", "xla", "reference")  # what `portable_kernels` builds on any platform


class PagedMetadata(NamedTuple):
    slot_mapping: jnp.ndarray  # i32[T]: cache slot of each new token; out of range = padding
    block_tables: jnp.ndarray  # i32[S, max_blocks_per_seq], padded with the null block
    context_lens: jnp.ndarray  # i32[S]: tokens in the cache after this step's writes
    query_start_loc: jnp.ndarray  # i32[S + 1]: row i's tokens are [qsl[i], qsl[i+1])


class AttentionKernels(NamedTuple):
    """One attention backend: how a step's K/V rows enter the cache, and how attention reads it."""

    # (cache [L, N, B, Hkv, D], rows [T, Hkv, D], slot_mapping i32[T], layer i32[]) -> cache
    # with the rows written at their slots of `layer` (out-of-range slots dropped)
    write: Callable
    # (q [T, Hq, D], k_pool [L*N, B, Hkv, D], v_pool, block_tables, context_lens, query_start_loc,
    #  *, sliding_window) -> out [T, Hq, D]: the ragged paged attention contract of pallas_kernels/
    attend: Callable
    # whether `attend` serves decode steps with a kernel of their own (decode_dispatch.py): it then takes
    # kind="decode" | "mixed", and the runner compiles a program per kind instead of a cond per layer
    splits_decode: bool = False


def scatter_kv(cache, rows, slot_mapping, layer):
    """The portable write: one XLA scatter of the rows at their slots of `layer`."""
    block_size = cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    return cache.at[layer, blocks, offsets].set(rows.astype(cache.dtype), mode="drop")


def portable_kernels(backend: str, platform: str) -> AttentionKernels:
    """The kernels of a backend that runs on any JAX platform ("gpu", "tpu", "cpu"):
    "pallas" (on a GPU, decode steps to the decode kernel and the others to the ragged one,
    decode_dispatch.py: 2x faster decode on an H200; elsewhere the ragged kernel for every
    step: on CPU its single-program tiling, in interpret mode, is the one measured fast),
    "xla" (the chunked loop for decode steps, the ragged kernel otherwise) or "reference"
    (the jnp ground truth)."""
    splits = False
    if backend == "pallas":
        if platform in ("gpu", "cuda", "rocm"):
            attend = functools.partial(decode_or_ragged, decode=decode_paged_attention, ragged=ragged_paged_attention)
            splits = True
        else:
            attend = ragged_paged_attention
    elif backend == "xla":
        attend = functools.partial(chunked_decode_attention, otherwise=ragged_paged_attention)
        splits = True
    elif backend == "reference":
        attend = ragged_paged_attention_reference
    else:
        raise ValueError(f"attention backend {backend!r} is not portable: choose one of {PORTABLE_BACKENDS}, or "
                         "ask the platform (paged_jax.platform) for its own")
    return AttentionKernels(write=scatter_kv, attend=attend, splits_decode=splits)


def paged_attention(q, k, v, kv_cache, layer, meta: PagedMetadata, *, kernels: AttentionKernels,
                    sliding_window=None, kind=None):
    """The model's attention_fn for the paged cache: write K/V at the slots with
    `kernels.write`, then attend through the block tables with `kernels.attend`.
    q [T, Hq, D]; k, v [T, Hkv, D]. `kind` ("decode" | "mixed", static): the step's kind,
    for kernels that split decode steps (`splits_decode`; None: they decide on device)."""
    kv_cache = {name: kernels.write(kv_cache[name], new, meta.slot_mapping, layer) for name, new in (("k", k), ("v", v))}
    # The kernels take one pool of blocks. Slicing out this layer (`cache[layer]`, a
    # dynamic index) copies it, i.e. the whole cache once per step over the layers
    # (measured: a decode step of 8 sequences took 120 ms with 100 blocks, 360 ms with
    # 3000). Viewing all layers as one pool of L * num_blocks blocks is a free reshape;
    # this layer's blocks are then its table entries offset by layer * num_blocks.
    num_layers, num_blocks = kv_cache["k"].shape[:2]
    pool = {name: kv_cache[name].reshape(num_layers * num_blocks, *kv_cache[name].shape[2:]) for name in ("k", "v")}
    tables = meta.block_tables + layer * num_blocks
    # the kernels take q in the cache's dtype (bf16 caches: bf16 q, f32 accumulation inside)
    extra = {"kind": kind} if kind is not None and kernels.splits_decode else {}
    out = kernels.attend(q.astype(pool["k"].dtype), pool["k"], pool["v"], tables, meta.context_lens,
                         meta.query_start_loc, sliding_window=sliding_window, **extra)
    return out.astype(q.dtype), kv_cache
