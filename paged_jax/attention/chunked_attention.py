"""Decode attention in plain XLA, bounded by the batch's real context (backend "xla").

Same contract as `pallas_kernels.ragged_paged_attention_reference` (a ragged batch; K/V
read through the block tables; slots past a context may hold anything, NaN included).
Most steps only decode (at most one query token per sequence); for those this walks each
sequence's table a chunk of `chunk_blocks` blocks at a time with an f32 online softmax,
in a `lax.fori_loop` whose trip count is the batch's longest context divided by the
chunk, a traced value: the step stays one compiled shape, and a step whose sequences are
short reads only their blocks. One gather of a sequence's chunk serves all its query
heads, as batched einsums. It still copies each gathered chunk before its dots (XLA on CPU
fuses no gather into a dot), which is why the native C++ kernel (cpu_kernels/, backend
"native") is the CPU default: `python -m experiments.step_profile` times all four.

A step with a prefill chunk goes to `otherwise` (the engine passes the Pallas kernel): a
first version ran such steps through this loop per query token, gathering a chunk per
token, and was far slower end to end on a prefill-heavy trace than the kernel, which
tiles a sequence's query tokens over one gather. Which of the two runs is decided inside
the step (decode_dispatch.py), since both kinds of step share padded shapes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from paged_jax.attention.decode_dispatch import decode_or_ragged

CHUNK_TOKENS = 128  # keys per loop iteration: ~6 MB of f32 K per 64 decode rows for SmolLM2


def chunked_decode_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, otherwise,
                             sm_scale=None, sliding_window=None, soft_cap=None, chunk_blocks=None, kind=None):
    """q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
    i32[S, max_blocks]; context_lens i32[S]; query_start_loc i32[S + 1]. Returns
    [T, Hq, D] in q's dtype (padding tokens: zeros). `otherwise(q, k_cache, ...,
    sm_scale=, sliding_window=, soft_cap=)` serves steps with a prefill chunk; `kind` as in
    decode_dispatch.decode_or_ragged."""
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    chunk_blocks = chunk_blocks or max(1, CHUNK_TOKENS // block_size)

    def decode(rows_q, k_cache, v_cache, tables, kv_lens, *, sm_scale, sliding_window, soft_cap):
        return _attend_rows(rows_q, tables, kv_lens, kv_lens - 1, k_cache=k_cache, v_cache=v_cache,
                            chunk_blocks=chunk_blocks, scale=head_dim ** -0.5 if sm_scale is None else sm_scale,
                            sliding_window=sliding_window, soft_cap=soft_cap)

    return decode_or_ragged(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, decode=decode,
                            ragged=otherwise, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                            kind=kind)


def _attend_rows(q, tables, kv_len, position, *, k_cache, v_cache, chunk_blocks, scale, sliding_window, soft_cap):
    """Row r's query q[r] [Hq, D] attends to keys [0, kv_len[r]) of its table (and, with a
    sliding window, only those after position[r] - window). kv_len 0: output zeros."""
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    width = -(-tables.shape[1] // chunk_blocks) * chunk_blocks  # whole chunks: the null block pads
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    chunk = chunk_blocks * block_size
    qg = q.reshape(num_rows, num_kv_heads, group, head_dim)
    offsets = jnp.arange(chunk)

    def body(c, carry):
        m, l, acc = carry
        ids = lax.dynamic_slice_in_dim(tables, c * chunk_blocks, chunk_blocks, axis=1)  # [R, C]
        keys = k_cache[ids].reshape(num_rows, chunk, num_kv_heads, head_dim)
        values = v_cache[ids].reshape(num_rows, chunk, num_kv_heads, head_dim)
        pos = c * chunk + offsets
        mask = pos[None, :] < kv_len[:, None]  # [R, chunk]
        if sliding_window is not None:
            mask &= pos[None, :] > position[:, None] - sliding_window
        s = jnp.einsum("rkgd,rnkd->rkgn", qg, keys, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
        correction = jnp.exp(m - m_safe)  # m = -inf: 0
        values = jnp.where(mask[:, :, None, None], values, 0)  # slots past the context may be NaN
        pv = jnp.einsum("rkgn,rnkd->rkgd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return m_new, l * correction + jnp.sum(p, axis=-1), acc * correction[..., None] + pv

    shape = (num_rows, num_kv_heads, group)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    num_chunks = (jnp.max(kv_len, initial=0) + chunk - 1) // chunk
    _, l, acc = lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_rows, num_heads, head_dim).astype(q.dtype)
