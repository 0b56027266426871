"""The ragged paged-attention kernel against the jnp reference (and the numpy oracle).

On CPU every kernel runs in Pallas interpret mode; where JAX's default backend is a GPU
(or TPU) the same test functions run the kernel natively (the `interpret` parameter
below, marked `gpu`/`tpu` there). The Triton tiling (group rows and head_dim padded to
powers of two, one program per query tile and KV head, masked stores) and the Mosaic
TPU kernel are also checked on CPU: the first in interpret mode, the second in TPU
interpret mode, and both lower for their platform through `jax.export`.

Tolerances: f32 atol 2e-5, rtol 1e-5; bf16 atol = rtol = 2e-2, against the reference
run in f32 on the same (bf16-rounded) inputs.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.helpers.kernel_cases import DEFAULT_BACKEND as _DEFAULT_BACKEND
from tests.helpers.kernel_cases import DEFAULT_MODE as _DEFAULT_MODE
from tests.helpers.kernel_cases import (assert_matches_ragged_reference, balanced_sample, case_id, case_params,
                                        edge_lengths, grid_context_lens, make_case, ragged_args)
from tests.helpers.kernel_cases import mode as _mode
from test_ragged_paged_attention_reference import _numpy_oracle

from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
)


_args, _check = ragged_args, assert_matches_ragged_reference


def _run(*args, backend=None, interpret=None, **kwargs):
    """ragged_paged_attention; TPU interpret mode runs on the CPU device whatever the default is."""
    if backend == "tpu" and interpret:
        with jax.default_device(jax.devices("cpu")[0]):
            return ragged_paged_attention(*args, backend=backend, interpret=interpret, **kwargs)
    return ragged_paged_attention(*args, backend=backend, interpret=interpret, **kwargs)


# the three kernels: the default one, the Triton tiling, the Mosaic TPU kernel
_ALL_MODES = [_mode(_DEFAULT_BACKEND, None, label="default-"), _mode("gpu", "gpu", label="gpu-"),
              _mode("tpu", "tpu", label="tpu-")]


# ------------------------------------------------------------------ hand-checked cases


@pytest.mark.parametrize("backend,interpret", _ALL_MODES)
def test_hand_case_prefill_chunk_decode_and_padding(backend, interpret):
    # block_size 2, one head, head_dim 1, q = 0: every attended key gets the same weight,
    # so each output is the mean of the values its token sees. Sequence 0 has 3 tokens in
    # blocks [2, 1] (values 1, 2, 3) and all 3 are queries (a prefill chunk): causal
    # means 1, (1+2)/2, (1+2+3)/3. Sequence 1: 3 tokens in blocks [3, 4] (values 5, 6, 7),
    # its last token is the query (decode) -> 6. Sequence 2 is empty. Token 4 is padding
    # -> 0. Every slot no sequence uses is NaN.
    k = np.full((5, 2, 1, 1), np.nan, np.float32)
    v = np.full((5, 2, 1, 1), np.nan, np.float32)
    for block, rows, values in ((2, 2, [1, 2]), (1, 1, [3]), (3, 2, [5, 6]), (4, 1, [7])):
        k[block, :rows] = 0.0
        v[block, :rows, 0, 0] = values
    q = np.zeros((5, 1, 1), np.float32)
    tables = np.array([[2, 1], [3, 4], [0, 0]], np.int32)
    call = functools.partial(_run, q, k, v, tables, np.array([3, 3, 0], np.int32),
                             np.array([0, 3, 4, 4], np.int32), backend=backend, interpret=interpret)
    np.testing.assert_allclose(np.asarray(call())[:, 0, 0], [1.0, 1.5, 2.0, 6.0, 0.0], rtol=1e-6)
    # sliding_window 2: each token sees itself and the one before it
    np.testing.assert_allclose(np.asarray(call(sliding_window=2))[:, 0, 0], [1.0, 1.5, 2.5, 6.5, 0.0], rtol=1e-6)


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
def test_hand_case_softmax_weights_and_cap(interpret):
    # One sequence of 2 tokens, both queries, block_size 2, head_dim 1, q = 1, sm_scale 1:
    # scores are the keys. Keys [0, ln 3], values [0, 4]. Token 0 sees key 0 only -> 0.
    # Token 1 weighs 1/4, 3/4 -> 3. With soft_cap c = ln 3 its second score becomes
    # c * tanh(1) = 0.8367: weights 1 and e^0.8367 = 2.3087 -> 4 * 2.3087 / 3.3087 = 2.7911.
    ln3 = float(np.log(3.0))
    k = np.array([[[[0.0]], [[ln3]]]], np.float32)
    v = np.array([[[[0.0]], [[4.0]]]], np.float32)
    call = functools.partial(ragged_paged_attention, np.ones((2, 1, 1), np.float32), k, v, np.zeros((1, 1), np.int32),
                             np.array([2], np.int32), np.array([0, 2], np.int32), sm_scale=1.0, interpret=interpret)
    np.testing.assert_allclose(np.asarray(call())[:, 0, 0], [0.0, 3.0], atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(call(soft_cap=ln3))[:, 0, 0], [0.0, 2.791], atol=1e-6, rtol=1e-3)


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
def test_empty_batch_gives_zeros_from_an_all_nan_cache(interpret):
    # no sequence has a query this step (q_len 0 everywhere, one context non-empty): every
    # token is padding
    k = np.full((3, 8, 2, 64), np.nan, np.float32)
    out = ragged_paged_attention(np.ones((4, 4, 64), np.float32), k, k, np.array([[1, 2], [2, 1]], np.int32),
                                 np.array([0, 5], np.int32), np.zeros(3, np.int32), interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


# --------------------------------------------------------------- randomized comparisons


_DEFAULT_CASES = 8  # checked in the default run; the rest of _CASES in `-m slow`
_CASES = balanced_sample(
    20, balanced_first=_DEFAULT_CASES, seed=11,
    num_seqs=list(range(1, 9)), group=[1, 2, 4, 7], head_dim=[64, 80, 128], block_size=[8, 16, 32, 64],
    window=[False, True], cap=[False, True], dtype=[np.float32, jnp.bfloat16])


def _ragged_case(index, c, *, num_kv_heads=2):
    """A ragged batch: context lengths at the block edges (0, 1, B-1, B, B+1, the maximum)
    and random ones; per sequence a decode row, a prefill chunk of 1..100 tokens, the
    whole context (when short) or no query at all; 0..3 padding tokens at the end."""
    rng = np.random.default_rng(1000 + index)
    block_size = c["block_size"]
    lens, max_blocks = grid_context_lens(rng, index, block_size, c["num_seqs"])
    q_lens = []
    for i, n in enumerate(lens):
        kind = (index + i) % 5
        if n == 0 or (kind == 4 and i > 0):
            q_lens.append(0)  # padding row, or a sequence with nothing to compute this step
        else:
            q_lens.append([1, int(rng.integers(1, min(n, 100) + 1)), min(n, 100), 1, 1][kind])
    case = make_case(rng, context_lens=lens, q_lens=q_lens, num_heads=c["group"] * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=c["head_dim"], block_size=block_size,
                     max_blocks_per_seq=max_blocks, dtype=c["dtype"], num_padding_tokens=index % 4)
    # windows of 1 (the token itself), inside a block, and across blocks; a cap that
    # bites (scores here are roughly standard normal)
    window = [1, block_size - 1 or 1, block_size + 3, 40][index % 4] if c["window"] else None
    return case, dict(sliding_window=window, soft_cap=1.5 if c["cap"] else None)


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
@pytest.mark.parametrize("index", case_params(range(len(_CASES)), [case_id(c) for c in _CASES], _DEFAULT_CASES))
def test_kernel_matches_reference(index, interpret):
    c = _CASES[index]
    case, kwargs = _ragged_case(index, c)
    _check(ragged_paged_attention(*_args(case), interpret=interpret, **kwargs), case, c["dtype"], **kwargs)


@pytest.mark.parametrize("interpret", [_mode("gpu")])
@pytest.mark.parametrize("index", case_params(range(0, len(_CASES), 3), [case_id(c) for c in _CASES[::3]], 3))
def test_triton_tiling_matches_reference(index, interpret):
    """The program Triton gets (one program per query tile and KV head, group rows and
    head_dim padded to powers of two, masked stores), in interpret mode unless a GPU is
    present."""
    c = _CASES[index]
    case, kwargs = _ragged_case(index, c, num_kv_heads=1)
    _check(ragged_paged_attention(*_args(case), backend="gpu", interpret=interpret, **kwargs), case, c["dtype"],
           **kwargs)


@pytest.mark.parametrize("backend,interpret", _ALL_MODES)
@pytest.mark.parametrize("sliding_window", [None, 13])
def test_numpy_oracle(backend, interpret, sliding_window):
    """The kernel against the reference's own ground truth, a loop over tokens and heads."""
    rng = np.random.default_rng(3)
    lens = edge_lengths(8, 48) + [30]
    case = make_case(rng, context_lens=lens, q_lens=[0, 1, 7, 3, 9, 48, 30][:len(lens)], num_heads=6,
                     num_kv_heads=2, head_dim=64, block_size=8, max_blocks_per_seq=6, num_padding_tokens=2)
    got = _run(*_args(case), sliding_window=sliding_window, backend=backend, interpret=interpret)
    clean = [np.nan_to_num(a) for a in (case.k_cache, case.v_cache)]
    want = _numpy_oracle(case.q, *clean, case.block_tables, case.context_lens, case.query_start_loc, sliding_window)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend,interpret", _ALL_MODES)
def test_only_pages_in_the_context_and_window_are_read(backend, interpret):
    """Table entries for pages no query needs (past the context, or wholly before the
    sliding window of the sequence's first query token) point far outside the cache. TPU
    interpret mode raises on an out-of-bounds DMA and a GPU faults, so this fails if the
    kernel touches them (CPU interpret mode clamps the read; there it checks the entries
    do not matter)."""
    block_size, window = 8, 11
    lens, q_lens = [0, 1, 7, 8, 9, 20, 32, 40], [0, 1, 3, 1, 9, 5, 1, 17]
    case = make_case(np.random.default_rng(5), context_lens=lens, q_lens=q_lens, num_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=block_size, max_blocks_per_seq=6, num_padding_tokens=1)
    poisoned = case.block_tables.copy()
    for i, (n, q_len) in enumerate(zip(lens, q_lens)):
        first = max(n - q_len + 1 - window, 0) // block_size
        end = -(-n // block_size)
        outside = np.r_[0:first, end:poisoned.shape[1]]
        poisoned[i, outside] = case.k_cache.shape[0] + 1000 + outside  # out of range
    q, k, v, _, lens, query_start_loc = _args(case)
    got = _run(q, k, v, poisoned, lens, query_start_loc, sliding_window=window, backend=backend,
               interpret=interpret)
    _check(got, case, np.float32, sliding_window=window)


@pytest.mark.parametrize("interpret", [_mode("tpu")])
@pytest.mark.parametrize("block_size,group,head_dim,window,cap,dtype", [
    (8, 1, 64, False, False, np.float32),
    (16, 3, 80, True, False, np.float32),
    (8, 7, 128, False, True, np.float32),
    (16, 4, 64, True, True, jnp.bfloat16),
    (32, 2, 128, False, False, jnp.bfloat16),
])
def test_tpu_kernel_matches_reference(block_size, group, head_dim, window, cap, dtype, interpret):
    """The Mosaic kernel (scalar-prefetched tiles and tables, page DMAs double-buffered,
    per-token output DMAs) under TPU interpret mode, which simulates its DMAs and
    semaphores and visits the parallel grid in a random order, on small shapes."""
    rng = np.random.default_rng(block_size + group)
    lens = edge_lengths(block_size, 3 * block_size) + [2 * block_size + 5]
    q_lens = [min(n, q) for n, q in zip(lens, [0, 1, 5, 1, 17, 1, 2 * block_size + 5])]
    case = make_case(rng, context_lens=lens, q_lens=q_lens, num_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, block_size=block_size, max_blocks_per_seq=3, dtype=dtype,
                     num_padding_tokens=3)
    kwargs = dict(sliding_window=block_size + 1 if window else None, soft_cap=1.5 if cap else None)
    _check(_run(*_args(case), backend="tpu", interpret=interpret, **kwargs), case, dtype, **kwargs)


# ---------------------------------------------------------------- lowering for devices


def _abstract_inputs(block_size, head_dim, dtype=jnp.bfloat16, num_tokens=40, num_seqs=4, num_heads=9,
                     num_kv_heads=3):
    spec = jax.ShapeDtypeStruct
    cache = spec((64, block_size, num_kv_heads, head_dim), dtype)
    return (spec((num_tokens, num_heads, head_dim), dtype), cache, cache, spec((num_seqs, 16), jnp.int32),
            spec((num_seqs,), jnp.int32), spec((num_seqs + 1,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (64, 64), (64, 128)])
@pytest.mark.parametrize("platform,backend,custom_call", [("tpu", "tpu", "tpu_custom_call"),
                                                          ("cuda", "gpu", "__gpu$xla.gpu.triton")])
def test_kernel_lowers_for_device(platform, backend, custom_call, block_size, head_dim, dtype):
    """Lowering on this machine: the Pallas -> Mosaic / Triton-IR step. Mosaic's and
    Triton's own compilers run only on the device, so this does not prove those pass."""
    fn = functools.partial(ragged_paged_attention, backend=backend, interpret=False, sliding_window=100,
                           soft_cap=30.0)
    disabled = [jax.export.DisabledSafetyCheck.custom_call(custom_call)] if platform == "cuda" else []
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(
        *_abstract_inputs(block_size, head_dim, dtype))
    assert custom_call in exported.mlir_module()
    assert exported.out_avals[0].shape == (40, 9, head_dim)


# ------------------------------------------------------------------------ bad inputs


def _good():
    case = make_case(np.random.default_rng(0), context_lens=[3, 5], q_lens=[3, 1], num_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=8, max_blocks_per_seq=2)
    return _args(case)


_BAD_INPUTS = {  # what is wrong -> (words of the error, how to break good inputs)
    "q dtype": ("share a dtype", lambda q, k, v, t, n, s: (q.astype(jnp.bfloat16), k, v, t, n, s)),
    "q head_dim": ("head_dim", lambda q, k, v, t, n, s: (q[..., :32], k, v, t, n, s)),
    "heads not divisible": ("multiple of num_kv_heads", lambda q, k, v, t, n, s: (q[:, :3], k, v, t, n, s)),
    "v_cache shape": ("k/v caches", lambda q, k, v, t, n, s: (q, k, v[..., :32], t, n, s)),
    "q rank": ("expected q", lambda q, k, v, t, n, s: (q[0], k, v, t, n, s)),
    "table rows": ("context_lens", lambda q, k, v, t, n, s: (q, k, v, t[:1], n, s)),
    "query_start_loc shape": ("query_start_loc", lambda q, k, v, t, n, s: (q, k, v, t, n, s[:-1])),
    "float table": ("block_tables must be an integer", lambda q, k, v, t, n, s: (q, k, v, t.astype(np.float32), n, s)),
    "float lens": ("context_lens must be an integer", lambda q, k, v, t, n, s: (q, k, v, t, n.astype(np.float32), s)),
}


@pytest.mark.parametrize("what", list(_BAD_INPUTS))
def test_bad_inputs_raise_value_error(what):
    message, change = _BAD_INPUTS[what]
    with pytest.raises(ValueError, match=re.escape(message)):
        ragged_paged_attention(*change(*_good()))


@pytest.mark.parametrize("kwargs,message", [
    (dict(backend="metal"), "backend"),
    (dict(backend="cpu", interpret=False), "interpret"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=2.5), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
])
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*_good(), **kwargs)


def test_gpu_tiling_needs_power_of_two_blocks():
    q, k, v, *meta = _good()
    with pytest.raises(ValueError, match="power-of-two block_size"):
        ragged_paged_attention(q, k[:, :6], v[:, :6], *meta, backend="gpu", interpret=True)
