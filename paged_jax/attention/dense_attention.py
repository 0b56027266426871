"""Dense attention over a contiguous per-sequence KV cache: the ground truth layout.

Row b of the cache holds the keys/values of sequence b at indices 0..len-1, the way a
naive server reserves memory. The paged engine must reproduce exactly what this
computes; it exists to be obviously right, not fast.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.config.model_config import ModelConfig


class DenseMetadata(NamedTuple):
    """Where the new tokens sit. Both i32[batch, num_new_tokens]."""

    positions: jnp.ndarray  # absolute position of each query token (causal mask, RoPE)
    write_positions: jnp.ndarray  # cache index to store its K/V; >= cache length drops it (padding)


def init_dense_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed cache {"k", "v"}: [num_layers, batch, max_len, num_kv_heads, head_dim]."""
    shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def dense_attention(q, k, v, kv_cache, layer, metadata: DenseMetadata, *, sliding_window=None):
    """Write the new K/V into layer `layer` of the cache, then attend causally.

    q [B, T, Hq, D]; k, v [B, T, Hkv, D]; kv_cache {"k", "v"}: [num_layers, B, S, Hkv, D].
    Query t of row b sees cache index j iff j <= positions[b, t] (and, with a sliding
    window W, j > positions[b, t] - W). Indices past a row's length hold zeros or stale
    padding; the mask keeps them out. Returns (out [B, T, Hq, D], updated kv_cache).
    """
    batch, num_new, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    rows = jnp.arange(batch)[:, None]
    kv_cache = {name: kv_cache[name].at[layer, rows, metadata.write_positions].set(
        new.astype(kv_cache[name].dtype), mode="drop") for name, new in (("k", k), ("v", v))}
    k_cache, v_cache = kv_cache["k"][layer], kv_cache["v"][layer]
    max_len = k_cache.shape[1]

    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_new, num_kv_heads, group, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg.astype(k_cache.dtype), k_cache, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    key_pos = jnp.arange(max_len)[None, None, :]
    query_pos = metadata.positions[:, :, None]
    mask = key_pos <= query_pos  # [B, T, S]
    if sliding_window is not None:
        mask = mask & (key_pos > query_pos - sliding_window)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_cache.dtype), v_cache,
                     preferred_element_type=jnp.float32)
    out = out.reshape(batch, num_new, num_heads, head_dim).astype(q.dtype)
    return out, kv_cache
