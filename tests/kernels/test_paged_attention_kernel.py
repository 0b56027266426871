"""The decode paged-attention kernel against the jnp reference.

On CPU every kernel runs in interpret mode; where JAX's default backend is a GPU (or TPU)
the same test functions run the kernel natively (the `interpret` parameter below, marked
`gpu`/`tpu` there). The Triton layout (padded group rows and head_dim) and the Mosaic TPU
kernel are also checked on CPU: the first in interpret mode, the second in TPU interpret
mode, and both lower for their platform through `jax.export`.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.helpers.kernel_cases import DEFAULT_BACKEND as _DEFAULT_BACKEND
from tests.helpers.kernel_cases import DEFAULT_MODE as _DEFAULT_MODE
from tests.helpers.kernel_cases import TOLERANCE as _TOLERANCE
from tests.helpers.kernel_cases import balanced_sample, case_id, case_params, edge_lengths, make_case
from tests.helpers.kernel_cases import mode as _mode

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference


def _inputs(seed, *, context_lens, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq=4,
            dtype=np.float32):
    """Permuted tables over a pool 3x larger than needed; unused blocks and slots hold NaN."""
    rng = np.random.default_rng(seed)
    case = make_case(rng, context_lens=context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=block_size, max_blocks_per_seq=max_blocks_per_seq, dtype=dtype)
    # decode: one query row per sequence, empty sequences included (make_case skips those)
    q = rng.normal(size=(len(context_lens), num_heads, head_dim)).astype(dtype)
    return q, case.k_cache, case.v_cache, case.block_tables, case.context_lens


def _check(got, inputs, dtype, **kwargs):
    """got vs the reference on the same inputs upcast to f32 (the exact answer for them;
    full f32 matmuls, which a GPU would otherwise run in TF32)."""
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got)), "kernel output has NaN/inf"
    q, k, v, tables, lens = inputs
    with jax.default_matmul_precision("highest"):
        want = paged_attention_reference(*(np.asarray(x, np.float32) for x in (q, k, v)), tables, lens, **kwargs)
    np.testing.assert_allclose(got, np.asarray(want), **_TOLERANCE[dtype])


def _run(backend, interpret, *args, **kwargs):
    """paged_attention; TPU interpret mode runs on the CPU device whatever the default is."""
    if backend == "tpu" and interpret:
        with jax.default_device(jax.devices("cpu")[0]):
            return paged_attention(*args, backend=backend, interpret=interpret, **kwargs)
    return paged_attention(*args, backend=backend, interpret=interpret, **kwargs)


# ------------------------------------------------------------------ hand-checked cases


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
def test_hand_case_uniform_weights(interpret):
    # block_size 2, one head, head_dim 1, q = 0: every attended key gets the same weight,
    # so the output is the mean of the attended values. Sequence 0: 3 tokens in blocks
    # [2, 1] with values 1, 2, 3 -> 2. Sequence 1: 1 token in block 3, value 5 -> 5.
    # Sequence 2: empty -> 0. Every slot no sequence uses is NaN.
    k = np.full((4, 2, 1, 1), np.nan, np.float32)
    v = np.full((4, 2, 1, 1), np.nan, np.float32)
    k[2, :, 0, 0], k[1, 0, 0, 0], k[3, 0, 0, 0] = 0.0, 0.0, 0.0
    v[2, 0], v[2, 1], v[1, 0], v[3, 0] = 1.0, 2.0, 3.0, 5.0
    q = np.zeros((3, 1, 1), np.float32)
    out = paged_attention(q, k, v, np.array([[2, 1], [3, 0], [0, 0]], np.int32), np.array([3, 1, 0], np.int32),
                          interpret=interpret)
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [2.0, 5.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
def test_hand_case_softmax_weights_window_and_cap(interpret):
    # One sequence, block_size 2, head_dim 1, q = 1, sm_scale 1: scores are the keys.
    # Keys [0, ln 3] with values [0, 4]: weights 1/4, 3/4 -> output 3.
    # With sliding_window 1 only the last key (value 4) is attended -> 4.
    # With soft_cap c = ln 3 the second score becomes c * tanh(1) = 0.8367, so the
    # weights are 1 and e^0.8367 = 2.3087 -> output 4 * 2.3087 / 3.3087 = 2.7911.
    ln3 = float(np.log(3.0))
    k = np.array([[[[0.0]], [[ln3]]]], np.float32)
    v = np.array([[[[0.0]], [[4.0]]]], np.float32)
    call = functools.partial(paged_attention, np.ones((1, 1, 1), np.float32), k, v, np.zeros((1, 1), np.int32),
                             np.array([2], np.int32), sm_scale=1.0, interpret=interpret)
    np.testing.assert_allclose(float(call()[0, 0, 0]), 3.0, rtol=1e-5)
    np.testing.assert_allclose(float(call(sliding_window=1)[0, 0, 0]), 4.0, rtol=1e-5)
    np.testing.assert_allclose(float(call(soft_cap=ln3)[0, 0, 0]), 2.791, rtol=1e-3)


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
def test_empty_sequences_give_zeros_from_an_all_nan_cache(interpret):
    k = np.full((3, 8, 2, 64), np.nan, np.float32)
    out = paged_attention(np.ones((2, 4, 64), np.float32), k, k, np.array([[1, 2], [2, 1]], np.int32),
                          np.zeros(2, np.int32), interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


# --------------------------------------------------------------- randomized comparisons


_DEFAULT_CASES = 8  # checked in the default run; the rest of _CASES in `-m slow`
_CASES = balanced_sample(
    24, balanced_first=_DEFAULT_CASES, seed=7,
    num_seqs=list(range(1, 9)), group=[1, 2, 4, 7], head_dim=[64, 80, 128], block_size=[8, 16, 32, 64],
    window=[False, True], cap=[False, True], dtype=[np.float32, jnp.bfloat16])


def _case_inputs(index, c, *, num_kv_heads=2):
    block_size = c["block_size"]
    edges = edge_lengths(block_size, 4 * block_size)  # 0, 1, B-1, B, B+1, 4B
    lens = [edges[(index + i) % len(edges)] for i in range(c["num_seqs"])]
    inputs = _inputs(index, context_lens=lens, num_heads=c["group"] * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_dim=c["head_dim"], block_size=block_size, dtype=c["dtype"])
    # a window that ends inside a block and starts in an earlier one; a cap that bites
    # (scores here are roughly standard normal)
    kwargs = dict(sliding_window=block_size + 3 if c["window"] else None, soft_cap=1.5 if c["cap"] else None)
    return inputs, kwargs


@pytest.mark.parametrize("interpret", [_DEFAULT_MODE])
@pytest.mark.parametrize("index", case_params(range(len(_CASES)), [case_id(c) for c in _CASES], _DEFAULT_CASES))
def test_kernel_matches_reference(index, interpret):
    c = _CASES[index]
    inputs, kwargs = _case_inputs(index, c)
    _check(paged_attention(*inputs, interpret=interpret, **kwargs), inputs, c["dtype"], **kwargs)


@pytest.mark.parametrize("interpret", [_mode("gpu")])
@pytest.mark.parametrize("index", case_params(range(0, len(_CASES), 3), [case_id(c) for c in _CASES[::3]], 3))
def test_triton_layout_matches_reference(index, interpret):
    """The program Triton gets (group rows padded to a power of two >= 16, head_dim to a
    power of two with masked loads), in interpret mode unless a GPU is present."""
    c = _CASES[index]
    inputs, kwargs = _case_inputs(index, c, num_kv_heads=1)
    _check(paged_attention(*inputs, backend="gpu", interpret=interpret, **kwargs), inputs, c["dtype"], **kwargs)


@pytest.mark.parametrize("interpret", [_mode("tpu")])
@pytest.mark.parametrize("block_size,group,window,cap,dtype", [
    (8, 1, False, False, np.float32),
    (16, 3, True, False, np.float32),
    (8, 2, False, True, np.float32),
    (16, 4, True, True, jnp.bfloat16),
])
def test_tpu_kernel_matches_reference(block_size, group, window, cap, dtype, interpret):
    """The Mosaic kernel (scalar-prefetched tables, DMA double buffering) under TPU
    interpret mode, which simulates its DMAs and semaphores, on small shapes."""
    lens = edge_lengths(block_size, 3 * block_size)
    inputs = _inputs(block_size + group, context_lens=lens, num_heads=2 * group, num_kv_heads=2, head_dim=64,
                     block_size=block_size, max_blocks_per_seq=3, dtype=dtype)
    kwargs = dict(sliding_window=block_size + 1 if window else None, soft_cap=1.5 if cap else None)
    _check(_run("tpu", interpret, *inputs, **kwargs), inputs, dtype, **kwargs)


@pytest.mark.parametrize("backend,interpret", [_mode(_DEFAULT_BACKEND, None, label="default-"),
                                               _mode("tpu", "tpu", label="tpu-")])
def test_only_blocks_in_the_context_and_window_are_read(backend, interpret):
    """Table entries for blocks the query does not need (past the context, or wholly
    before the sliding window) point far outside the cache. TPU interpret mode raises on
    an out-of-bounds DMA and a GPU faults, so this fails if the kernel touches them (CPU
    interpret mode clamps the read; there it checks the entries do not matter)."""
    block_size, window = 8, 11
    lens = [0, 1, 7, 8, 9, 20, 32]
    inputs = _inputs(5, context_lens=lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size)
    q, k, v, tables, _ = inputs
    poisoned = tables.copy()
    for i, n in enumerate(lens):
        first = max(n - window, 0) // block_size
        end = -(-n // block_size)
        outside = np.r_[0:first, end:tables.shape[1]]
        poisoned[i, outside] = k.shape[0] + 1000 + outside  # out of range
    got = _run(backend, interpret, q, k, v, poisoned, np.array(lens, np.int32), sliding_window=window)
    _check(got, inputs, np.float32, sliding_window=window)


# ---------------------------------------------------------------- lowering for devices


def _abstract_inputs(block_size, head_dim, dtype=jnp.bfloat16, num_seqs=4, num_heads=9, num_kv_heads=3):
    spec = jax.ShapeDtypeStruct
    cache = spec((64, block_size, num_kv_heads, head_dim), dtype)
    return (spec((num_seqs, num_heads, head_dim), dtype), cache, cache, spec((num_seqs, 16), jnp.int32),
            spec((num_seqs,), jnp.int32))


# (8, 80): Triton's path for blocks under 16 keys and its masked loads of a padded head_dim
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (64, 64), (64, 128), (8, 80)])
@pytest.mark.parametrize("platform,backend,custom_call", [("tpu", "tpu", "tpu_custom_call"),
                                                          ("cuda", "gpu", "__gpu$xla.gpu.triton")])
def test_kernel_lowers_for_device(platform, backend, custom_call, block_size, head_dim):
    """Lowering on this machine: the Pallas -> Mosaic / Triton-IR step. Mosaic's and
    Triton's own compilers run only on the device, so this does not prove those pass."""
    fn = functools.partial(paged_attention, backend=backend, interpret=False, sliding_window=100, soft_cap=30.0)
    disabled = [jax.export.DisabledSafetyCheck.custom_call(custom_call)] if platform == "cuda" else []
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(
        *_abstract_inputs(block_size, head_dim))
    assert custom_call in exported.mlir_module()
    assert exported.out_avals[0].shape == (4, 9, head_dim)


# ------------------------------------------------------------------------ bad inputs


def _good():
    return _inputs(0, context_lens=[3, 5], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)


_BAD_INPUTS = {  # what is wrong -> (words of the error, how to break good inputs)
    "q dtype": ("share a dtype", lambda q, k, v, t, n: (q.astype(jnp.bfloat16), k, v, t, n)),
    "q head_dim": ("head_dim", lambda q, k, v, t, n: (q[..., :32], k, v, t, n)),
    "heads not divisible": ("multiple of num_kv_heads", lambda q, k, v, t, n: (q[:, :3], k, v, t, n)),
    "v_cache shape": ("k_cache and v_cache", lambda q, k, v, t, n: (q, k, v[..., :32], t, n)),
    "q rank": ("q must be", lambda q, k, v, t, n: (q[0], k, v, t, n)),
    "table rows": ("block_tables must be [", lambda q, k, v, t, n: (q, k, v, t[:1], n)),
    "table rank": ("block_tables must be [", lambda q, k, v, t, n: (q, k, v, t[0], n)),
    "lens shape": ("context_lens must be [", lambda q, k, v, t, n: (q, k, v, t, n[:, None])),
    "float table": ("block_tables must be an integer", lambda q, k, v, t, n: (q, k, v, t.astype(np.float32), n)),
    "float lens": ("context_lens must be an integer", lambda q, k, v, t, n: (q, k, v, t, n.astype(np.float32))),
}


@pytest.mark.parametrize("what", list(_BAD_INPUTS))
def test_bad_inputs_raise_value_error(what):
    message, change = _BAD_INPUTS[what]
    bad = change(*_good())
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention(*bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention_reference(*bad)


@pytest.mark.parametrize("kwargs,message", [
    (dict(backend="metal"), "backend"),
    (dict(backend="cpu", interpret=False), "interpret"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(soft_cap=-1.0), "soft_cap"),
])
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        paged_attention(*_good(), **kwargs)
