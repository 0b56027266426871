"""decode_or_ragged and the "pallas" backend on a GPU platform (its kernels in interpret
mode here, natively on a GPU).

The dispatch: decode batches (at most one query per sequence, some with none, padding
tokens) go to `decode`, whose rows land at their tokens; a batch with any longer chunk
goes to `ragged` whole. Then the GPU backend end to end against the jnp reference on
both kinds of batch from the kernel suites' randomized grid.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention.decode_dispatch import decode_or_ragged
from paged_jax.attention.paged_attention import portable_kernels
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.helpers.kernel_cases import assert_matches_ragged_reference, make_case, ragged_args


def _batch(q_lens, context_lens, *, seed=0, num_padding_tokens=2, dtype=np.float32, group=2):
    return make_case(np.random.default_rng(seed), context_lens=context_lens, q_lens=q_lens, num_heads=2 * group,
                     num_kv_heads=2, head_dim=64, block_size=8, max_blocks_per_seq=5, dtype=dtype,
                     num_padding_tokens=num_padding_tokens)


def _decode_marks_rows(rows_q, k_cache, v_cache, tables, kv_lens, **options):
    """Row r's output is kv_lens[r] + 1000 everywhere: shows which row landed where."""
    return jnp.broadcast_to((kv_lens + 1000.0)[:, None, None], rows_q.shape).astype(rows_q.dtype)


def _ragged_marks_all(q, *args, **options):
    return jnp.full_like(q, -7.0)


def test_decode_batch_goes_to_decode_with_rows_at_their_tokens():
    # sequence 1 has no query this step; two padding tokens follow the three real ones
    case = _batch([1, 0, 1, 1], [5, 9, 17, 1])
    out = np.asarray(decode_or_ragged(*ragged_args(case), decode=_decode_marks_rows, ragged=_ragged_marks_all))
    # tokens 0, 1, 2 are sequences 0, 2, 3 (context 5, 17, 1); padding rows stay zero
    np.testing.assert_array_equal(out[:, 0, 0], [1005.0, 1017.0, 1001.0, 0.0, 0.0])


def test_a_prefill_chunk_sends_the_whole_batch_to_ragged():
    case = _batch([1, 3, 1], [5, 9, 17])
    out = np.asarray(decode_or_ragged(*ragged_args(case), decode=_decode_marks_rows, ragged=_ragged_marks_all))
    assert np.all(out == -7.0)


@pytest.mark.parametrize("kind,q_lens,context_lens", [
    ("decode", [1, 0, 1, 1, 1], [8, 3, 40, 1, 17]),
    ("mixed", [1, 7, 0, 20, 1], [9, 7, 12, 33, 40]),
])
@pytest.mark.parametrize("window,cap", [(None, None), (11, 2.0)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_pallas_backend_matches_the_reference(kind, q_lens, context_lens, window, cap, dtype):
    case = _batch(q_lens, context_lens, seed=len(kind), dtype=dtype, group=3)
    attend = portable_kernels("pallas", "gpu").attend
    got = attend(*ragged_args(case), sliding_window=window, soft_cap=cap)
    assert_matches_ragged_reference(got, case, dtype, sliding_window=window, soft_cap=cap)


def test_other_platforms_take_the_ragged_kernel_for_every_step():
    assert portable_kernels("pallas", "cpu").attend is ragged_paged_attention
    assert portable_kernels("pallas", "tpu").attend is ragged_paged_attention
    assert isinstance(portable_kernels("pallas", "cuda").attend, functools.partial)
