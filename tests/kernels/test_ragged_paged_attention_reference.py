"""The jnp ragged paged-attention reference against a numpy loop over sequences."""

import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


def _numpy_oracle(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, sliding_window=None):
    out = np.zeros_like(q)
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_cache.shape[2]
    for i, ctx in enumerate(context_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        keys = np.concatenate([k_cache[b] for b in block_tables[i]])[:ctx]  # [ctx, Hkv, D]
        values = np.concatenate([v_cache[b] for b in block_tables[i]])[:ctx]
        for t in range(start, end):
            pos = ctx - (end - t)
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_heads):
                s = keys[lo:pos + 1, h // group] @ q[t, h] * head_dim ** -0.5
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ values[lo:pos + 1, h // group]
    return out


def test_hand_case_two_sequences():
    # block_size 2, one head, head_dim 1 (scale 1). Sequence 0: 3 tokens in blocks [2, 1]
    # with values 1, 2, 3; its one query (position 2) has q = 0, so it averages all three: 2.
    # Sequence 1: 1 token in block 3 with value 5; q_len 1 -> output 5. Token 2 is padding -> 0.
    k = np.zeros((4, 2, 1, 1), np.float32)
    v = np.zeros((4, 2, 1, 1), np.float32)
    v[2, 0], v[2, 1], v[1, 0], v[3, 0] = 1.0, 2.0, 3.0, 5.0
    q = np.zeros((3, 1, 1), np.float32)
    out = ragged_paged_attention_reference(q, k, v, np.array([[2, 1], [3, 0]]), np.array([3, 1]),
                                           np.array([0, 1, 2]))
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [2.0, 5.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_random_mixed_batches_match_the_loop(block_size, sliding_window):
    rng = np.random.default_rng(block_size)
    num_heads, num_kv_heads, head_dim, max_blocks = 4, 2, 8, 6
    max_len = max_blocks * block_size
    # context lengths around block edges, 1 and the maximum; q_len 1 (decode) or a chunk
    context_lens = np.array(sorted({1, block_size - 1 or 1, block_size + 1, max_len, 3}))
    context_lens = np.minimum(context_lens, max_len)
    q_lens = np.array([1 if i % 2 else min(c, 1 + rng.integers(c)) for i, c in enumerate(context_lens)])
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)])
    num_tokens = int(query_start_loc[-1]) + 3  # three padding tokens
    num_blocks = len(context_lens) * max_blocks + 1
    perm = rng.permutation(np.arange(1, num_blocks))  # scattered physical blocks
    block_tables = perm[: len(context_lens) * max_blocks].reshape(len(context_lens), max_blocks)
    k = rng.normal(size=(num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    q = rng.normal(size=(num_tokens, num_heads, head_dim)).astype(np.float32)
    got = ragged_paged_attention_reference(q, k, v, block_tables, context_lens, query_start_loc,
                                           sliding_window=sliding_window)
    want = _numpy_oracle(q, k, v, block_tables, context_lens, query_start_loc, sliding_window)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    assert not np.asarray(got)[-3:].any()  # padding tokens give zeros


def test_shape_errors():
    q = np.zeros((2, 4, 8), np.float32)
    cache = np.zeros((3, 2, 3, 8), np.float32)  # 4 heads do not group over 3 kv heads
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention_reference(q, cache, cache, np.zeros((1, 2), np.int32), np.array([1]),
                                         np.array([0, 1]))
    with pytest.raises(ValueError, match="query_start_loc"):
        ragged_paged_attention_reference(q, cache[:, :, :2], cache[:, :, :2], np.zeros((1, 2), np.int32),
                                         np.array([1]), np.array([0, 1, 2]))


def test_nan_outside_the_tables_does_not_leak():
    from tests.helpers.kernel_cases import edge_lengths, make_case
    rng = np.random.default_rng(0)
    lens = edge_lengths(8, 40)
    case = make_case(rng, context_lens=lens, q_lens=[min(n, 3) for n in lens], num_heads=4, num_kv_heads=2,
                     head_dim=8, block_size=8, max_blocks_per_seq=5, num_padding_tokens=2)
    got = np.asarray(ragged_paged_attention_reference(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                      case.context_lens, case.query_start_loc))
    assert np.isfinite(got).all()
    clean = [np.nan_to_num(a) for a in (case.k_cache, case.v_cache)]
    want = _numpy_oracle(case.q, *clean, case.block_tables, case.context_lens, case.query_start_loc)
    np.testing.assert_allclose(got, want, atol=1e-5)
