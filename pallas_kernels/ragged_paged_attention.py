"""Ragged paged attention: a mixed batch of prefill chunks and decode tokens.

Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) of the flat
token axis: the last q_len_i of its context_lens[i] tokens (a prefill chunk, or one
decode token). Its keys and values live in the paged cache, block b of the sequence at
physical block block_tables[i, b]. Attention is causal within the sequence.

This file holds the pure-jnp reference (gather each token's blocks through the block
table, dense masked softmax), the ground truth for the Pallas kernel and the engine's
"reference" attention backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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
