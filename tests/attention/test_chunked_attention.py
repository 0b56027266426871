"""The XLA chunked decode attention (the attention backend "xla") against the jnp reference.

Decode batches from the Pallas kernel's randomized grid (contexts at the block edges,
sequences without a query this step, padding tokens, GQA 1..7, head_dim 64/80/128, block
sizes 8..64, windows and soft caps, f32 and bf16; every slot outside the tables is NaN),
with chunk sizes that do and do not divide the table width; and batches with a prefill
chunk, which must go to `otherwise` whole.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention.chunked_attention import chunked_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.helpers.kernel_cases import (assert_matches_ragged_reference, balanced_sample, case_id,
                                        grid_context_lens, make_case, ragged_args)


_CASES = balanced_sample(
    10, seed=23, num_seqs=list(range(1, 9)), group=[1, 2, 4, 7], head_dim=[64, 80, 128], block_size=[8, 16, 32, 64],
    window=[False, True], cap=[False, True], dtype=[np.float32, jnp.bfloat16], chunk_blocks=[1, 3, None])


def _case(index, c):
    """A decode batch: one query per non-empty sequence, and (with several) one sequence
    without a query this step."""
    rng = np.random.default_rng(2000 + index)
    block_size = c["block_size"]
    lens, max_blocks = grid_context_lens(rng, index, block_size, c["num_seqs"])
    q_lens = [min(n, 1) if i != 1 else 0 for i, n in enumerate(lens)]
    case = make_case(rng, context_lens=lens, q_lens=q_lens, num_heads=c["group"] * 2, num_kv_heads=2,
                     head_dim=c["head_dim"], block_size=block_size, max_blocks_per_seq=max_blocks,
                     dtype=c["dtype"], num_padding_tokens=index % 4)
    window = [1, block_size - 1 or 1, block_size + 3, 40][index % 4] if c["window"] else None
    return case, dict(sliding_window=window, soft_cap=1.5 if c["cap"] else None)


def _nan(q, *args, **kwargs):
    """An `otherwise` whose output would show if a decode batch took the ragged path
    (lax.cond traces both branches, so it is called, but its result must be unused)."""
    return jnp.full_like(q, jnp.nan)


@pytest.mark.parametrize("index", range(len(_CASES)), ids=[case_id(c) for c in _CASES])
def test_decode_batches_match_the_reference(index):
    c = _CASES[index]
    case, kwargs = _case(index, c)
    attend = jax.jit(functools.partial(chunked_decode_attention, otherwise=_nan, chunk_blocks=c["chunk_blocks"],
                                       **kwargs))
    assert_matches_ragged_reference(attend(*ragged_args(case)), case, c["dtype"], **kwargs)


def test_batches_with_a_prefill_chunk_go_to_otherwise():
    """The hand case of the kernel tests (q = 0: each output is the mean of the values its
    token sees): with a 3-token chunk the whole batch is `otherwise`'s (here the reference
    plus 100, to tell), with its options; as decodes only, the loop's."""
    k = np.full((5, 2, 1, 1), np.nan, np.float32)
    v = np.full((5, 2, 1, 1), np.nan, np.float32)
    for block, rows, values in ((2, 2, [1, 2]), (1, 1, [3]), (3, 2, [5, 6]), (4, 1, [7])):
        k[block, :rows] = 0.0
        v[block, :rows, 0, 0] = values
    tables, lens = np.array([[2, 1], [3, 4], [0, 0]], np.int32), np.array([3, 3, 0], np.int32)

    def otherwise(*args, **kwargs):
        return ragged_paged_attention_reference(*args, **kwargs) + 100.0

    mixed = chunked_decode_attention(np.zeros((5, 1, 1), np.float32), k, v, tables, lens,
                                     np.array([0, 3, 4, 4], np.int32), otherwise=otherwise, sliding_window=2)
    np.testing.assert_allclose(np.asarray(mixed)[:, 0, 0], [101.0, 101.5, 102.5, 106.5, 100.0], rtol=1e-6)
    decode = functools.partial(chunked_decode_attention, np.zeros((3, 1, 1), np.float32), k, v, tables, lens,
                               np.array([0, 1, 2, 2], np.int32), otherwise=_nan, chunk_blocks=1)
    np.testing.assert_allclose(np.asarray(decode())[:2, 0, 0], [2.0, 6.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(decode(sliding_window=2))[:2, 0, 0], [2.5, 6.5], rtol=1e-6)
