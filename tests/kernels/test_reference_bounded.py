"""The chunked (online-softmax) jnp reference against a dense oracle, and its memory bound.

`_dense_oracle` is the reference's former formulation, kept here only as an independent
check: every query token gathers its whole block table at once and takes a dense masked
softmax. The reference walks the table a chunk of blocks at a time, so its temporaries
follow the chunk, not max_blocks_per_seq; the memory test compiles both (abstract
shapes, nothing allocated) and compares XLA's temp sizes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.helpers.kernel_cases import grid_context_lens, make_case, ragged_args

from pallas_kernels.ragged_paged_attention import REFERENCE_CHUNK_TOKENS, ragged_paged_attention_reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def _dense_oracle(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                  sm_scale=None, sliding_window=None, soft_cap=None):
    """Each token gathers its whole table: [num_tokens, max_blocks * block_size, Hkv, D]."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), num_seqs - 1)
    valid = token < query_start_loc[num_seqs]
    position = context_lens[seq] - (query_start_loc[seq + 1] - token)
    tables = block_tables[seq]
    keys = k_cache[tables].reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[tables].reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(max_blocks * block_size)[None, :]
    in_context = key_pos < context_lens[seq][:, None]
    values = jnp.where(in_context[:, :, None, None], values, 0)
    mask = (key_pos <= position[:, None]) & valid[:, None] & in_context
    if sliding_window is not None:
        mask &= key_pos > position[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("tkgs,tskd->tkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _q_lens(kind, lens, rng):
    if kind == "decode":
        return None
    if kind == "prefill":  # whole prompts and chunks ending the context
        return [n if i % 2 else min(n, 1 + int(rng.integers(40))) for i, n in enumerate(lens)]
    return [min(n, 1) if i % 2 else min(n, 1 + int(rng.integers(n or 1))) for i, n in enumerate(lens)]  # mixed


# block sizes 1 (a 128-block chunk), 5 (125-token chunks: not a power of two), 16 (8-block
# chunks); max_tokens 300 makes every table span two or three chunks. Each (kind, block
# size) pair gets two of the four option sets; every kind and every block size sees all four.
OPTIONS = (("plain", {}), ("win7", dict(sliding_window=7)),
           ("win140-cap", dict(sliding_window=140, soft_cap=5.0)), ("scale-cap", dict(sm_scale=0.3, soft_cap=2.0)))
CASES = [pytest.param(kind, b, OPTIONS[j][1], id=f"{kind}-b{b}-{OPTIONS[j][0]}")
         for i, (kind, b) in enumerate((k, b) for k in ("decode", "prefill", "mixed") for b in (1, 5, 16))
         for j in (i % 4, (i + 2) % 4)]


@pytest.mark.parametrize("kind,block_size,opts", CASES)
def test_matches_the_dense_oracle(kind, block_size, opts):
    rng = np.random.default_rng(block_size * 7 + len(kind) + len(opts))
    lens, max_blocks = grid_context_lens(rng, block_size + len(opts), block_size, num_seqs=5, max_tokens=300)
    # block edges (0, 1, B-1, B, B+1, the max), NaN in every unused block and table slot,
    # and padding tokens after the batch
    case = make_case(rng, context_lens=lens, q_lens=_q_lens(kind, lens, rng), num_heads=4, num_kv_heads=2,
                     head_dim=8, block_size=block_size, max_blocks_per_seq=max_blocks, num_padding_tokens=3)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ragged_paged_attention_reference(*ragged_args(case), **opts))
        want = np.asarray(_dense_oracle(*ragged_args(case), **opts))
    assert np.all(np.isfinite(got)), "NaN from unused slots leaked"
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not got[case.query_start_loc[-1]:].any(), "padding tokens must give zeros"


def test_bf16_and_short_batches():
    # bf16 in, bf16 out; and a batch whose contexts fit in one chunk of a long table
    rng = np.random.default_rng(3)
    case = make_case(rng, context_lens=[1, 17, 40], q_lens=[1, 17, 5], num_heads=4, num_kv_heads=1, head_dim=16,
                     block_size=4, max_blocks_per_seq=96, dtype=jnp.bfloat16, num_padding_tokens=2)
    got = ragged_paged_attention_reference(*ragged_args(case), sliding_window=9)
    assert got.dtype == jnp.bfloat16
    want = _dense_oracle(*ragged_args(case), sliding_window=9)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def _temp_bytes(fn, num_tokens, max_blocks, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64):
    shape = jax.ShapeDtypeStruct
    cache = shape((1 + max_blocks, block_size, num_kv_heads, head_dim), jnp.float32)
    args = (shape((num_tokens, num_heads, head_dim), jnp.float32), cache, cache,
            shape((1, max_blocks), jnp.int32), shape((1,), jnp.int32), shape((2,), jnp.int32))
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _check_bounded(fn):
    """A 256-token prefill chunk at max_model_len 2048 (128 blocks of 16): the dense
    gather holds K and V for all 2048 slots of every token (fails for _dense_oracle)."""
    dense = _temp_bytes(_dense_oracle, 256, 128)
    new = _temp_bytes(fn, 256, 128)
    one_chunk_kv = 2 * 256 * REFERENCE_CHUNK_TOKENS * 2 * 64 * 4  # K and V of one chunk, f32
    assert new * 8 < dense, f"reference temp {new / 2**20:.1f} MiB vs dense {dense / 2**20:.1f} MiB"
    assert new < 2 * one_chunk_kv, f"reference temp {new / 2**20:.1f} MiB, one chunk's K/V {one_chunk_kv / 2**20:.1f}"
    # a table twice as long costs (about) nothing more
    assert _temp_bytes(fn, 256, 256) < 1.1 * new


def test_memory_is_bounded_by_the_chunk_not_the_table():
    _check_bounded(ragged_paged_attention_reference)
