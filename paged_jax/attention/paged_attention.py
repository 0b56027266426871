"""The model's attention_fn on the paged KV cache: write the new K/V at their slots, then
attend through the block tables with the C++ CPU kernel (cpu_kernels/), the Pallas kernel,
its jnp reference (pallas_kernels/ragged_paged_attention.py) or the XLA chunked loop
(chunked_attention.py).

The cache layout is paged_jax/worker/kv_cache.py's: {"k", "v"}, each
[num_layers, num_blocks, block_size, num_kv_heads, head_dim]. A token at position p of a
sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`;
padded tokens carry slot `num_blocks * block_size`, which the scatter drops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cpu_kernels.ragged_paged_attention import ragged_paged_attention_cpu
from cpu_kernels.write_kv import write_kv
from paged_jax.attention.chunked_attention import chunked_decode_attention
from paged_jax.attention.decode_dispatch import decode_or_ragged
from pallas_kernels.paged_attention import paged_attention as decode_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference


class PagedMetadata(NamedTuple):
    slot_mapping: jnp.ndarray  # i32[T]: cache slot of each new token; out of range = padding
    block_tables: jnp.ndarray  # i32[S, max_blocks_per_seq], padded with the null block
    context_lens: jnp.ndarray  # i32[S]: tokens in the cache after this step's writes
    query_start_loc: jnp.ndarray  # i32[S + 1]: row i's tokens are [qsl[i], qsl[i+1])


def paged_attention(q, k, v, kv_cache, layer, meta: PagedMetadata, *, sliding_window=None, backend="reference"):
    """The model's attention_fn for the paged cache: write K/V at the slots, then attend
    through the block tables with the C++ CPU kernel (backend "native",
    cpu_kernels/ragged_paged_attention.cc), the Pallas kernels ("pallas"), the XLA chunked
    loop for decode steps and the kernel for the others ("xla", chunked_attention.py) or
    the jnp reference ("reference").
    q [T, Hq, D]; k, v [T, Hkv, D]."""
    _, num_blocks, block_size = kv_cache["k"].shape[:3]
    if backend == "native":  # in place in any dtype (XLA's CPU scatter has no bf16 path)
        kv_cache = {name: write_kv(kv_cache[name], new, meta.slot_mapping, layer) for name, new in (("k", k), ("v", v))}
    else:
        blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        kv_cache = {name: kv_cache[name].at[layer, blocks, offsets].set(new.astype(kv_cache[name].dtype), mode="drop")
                    for name, new in (("k", k), ("v", v))}
    attend = {"native": ragged_paged_attention_cpu,
              "pallas": pallas_attention(jax.default_backend()),
              "xla": functools.partial(chunked_decode_attention, otherwise=ragged_paged_attention),
              "reference": ragged_paged_attention_reference}[backend]
    # The kernels take one pool of blocks. Slicing out this layer (`cache[layer]`, a
    # dynamic index) copies it, i.e. the whole cache once per step over the layers
    # (measured: a decode step of 8 sequences took 120 ms with 100 blocks, 360 ms with
    # 3000). Viewing all layers as one pool of L * num_blocks blocks is a free reshape;
    # this layer's blocks are then its table entries offset by layer * num_blocks.
    num_layers = kv_cache["k"].shape[0]
    pool = {name: kv_cache[name].reshape(num_layers * num_blocks, *kv_cache[name].shape[2:]) for name in ("k", "v")}
    tables = meta.block_tables + layer * num_blocks
    # the kernels take q in the cache's dtype (bf16 caches: bf16 q, f32 accumulation inside)
    out = attend(q.astype(pool["k"].dtype), pool["k"], pool["v"], tables, meta.context_lens, meta.query_start_loc,
                 sliding_window=sliding_window)
    return out.astype(q.dtype), kv_cache


def pallas_attention(platform: str):
    """The "pallas" backend on a JAX platform: on a GPU, decode steps go to the decode
    kernel and the others to the ragged kernel (decode_dispatch.py: 2x faster decode on an
    H200); elsewhere the ragged kernel takes every step (on CPU, in interpret mode, its
    single-program tiling is the one measured fast)."""
    if platform in ("gpu", "cuda", "rocm"):
        return functools.partial(decode_or_ragged, decode=decode_paged_attention, ragged=ragged_paged_attention)
    return ragged_paged_attention
