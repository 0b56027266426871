"""The AVX-512 f32 matmul (cpu_kernels/f32_matmul.cc) against XLA's dot, in both weight
layouts it reads, its column packing against its formula, and the runner's f32 serving
layout and head.

On a machine without AVX-512 the kernel tests assert that the CPU indeed lacks it (so a
build that silently lost it fails here) and the runner test checks the fallback layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build, f32_matmul

HAS_AVX512 = "avx512f" in build._cpu_flags().split()


def test_packing_follows_the_column_formula():
    w = np.arange(40 * 48, dtype=np.float32).reshape(40, 48)
    packed = np.asarray(f32_matmul.pack_columns(jnp.asarray(w)))
    assert packed.shape == (3, 40, 16)
    for j, k, c in [(0, 0, 0), (1, 5, 7), (2, 39, 15), (0, 17, 3)]:
        assert packed[j, k, c] == w[k, 16 * j + c]
    assert sorted(packed.ravel()) == sorted(w.ravel())


def test_shapes_that_do_not_fit_are_refused():
    assert not f32_matmul.fits(jnp.zeros((64, 24)))  # N % 16
    with pytest.raises(ValueError, match="N % 16"):
        f32_matmul.pack_columns(jnp.zeros((64, 24)))
    with pytest.raises(ValueError, match="f32 weights"):
        f32_matmul.f32_matmul(jnp.zeros((4, 64)), jnp.zeros((64, 32), jnp.bfloat16))


def test_supported_exactly_where_the_cpu_has_avx512():
    assert f32_matmul.supported() == HAS_AVX512


def _want(x, w):
    return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 16), (37, 576, 192), (64, 1536, 48), (13, 37, 80), (300, 64, 208)])
def test_matches_xla_dot(rows, k, n, packed):
    if not HAS_AVX512:
        assert not f32_matmul.supported()
        return
    rng = np.random.default_rng(rows + k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, rows, k)), jnp.float32)  # leading dims; rows past a tile and a panel
    got = jax.jit(f32_matmul.f32_matmul)(x, f32_matmul.pack_columns(w) if packed else w)
    want = _want(x, w)
    assert got.shape == want.shape and got.dtype == jnp.float32
    # both sum the same f32 products; only the order differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6 * k)


def test_several_weights_in_one_call_match_xla_dots():
    if not HAS_AVX512:
        assert not f32_matmul.supported()
        return
    rng = np.random.default_rng(3)
    # q, k, v-like widths, one of them packed; 208 columns is an odd number of 16-column blocks
    ws = [jnp.asarray(rng.standard_normal((96, n)), jnp.float32) for n in (64, 32, 208)]
    x = jnp.asarray(rng.standard_normal((3, 37, 96)), jnp.float32)
    got = jax.jit(f32_matmul.f32_matmul_many)(x, ws[0], f32_matmul.pack_columns(ws[1]), ws[2])
    assert len(got) == 3
    for w, out in zip(ws, got):
        want = _want(x, w)
        assert out.shape == want.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=2e-6 * 96)


@pytest.mark.parametrize("rows,k", [(1, 64), (45, 64), (300, 64), (270, 400)])  # 400: K in slices
def test_swiglu_matches_silu_of_gate_times_up(rows, k):
    if not HAS_AVX512:
        assert not f32_matmul.supported()
        return
    rng = np.random.default_rng(rows)
    gate, up = (jnp.asarray(rng.standard_normal((k, 80)) * 2.4 / np.sqrt(k), jnp.float32) for _ in range(2))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    got = jax.jit(f32_matmul.f32_swiglu)(x, *map(f32_matmul.pack_columns, (gate, up)))
    g = _want(x, gate)
    want = jax.nn.silu(g) * _want(x, up)
    assert got.shape == (rows, 80) and got.dtype == jnp.float32
    assert float(jnp.min(g)) < -2 and float(jnp.max(g)) > 2  # both branches of the sigmoid ran
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n,k", [(1, 48, 64), (37, 208, 64), (300, 96, 64), (270, 96, 400)])
def test_logits_argmax_is_the_first_max_of_the_logits_it_returns(rows, n, k):
    if not HAS_AVX512:
        assert not f32_matmul.supported()
        return
    from paged_jax.worker.step_head import first_max
    rng = np.random.default_rng(rows + n)
    w = rng.standard_normal((k, n))
    w[:, 40] += 1.0  # large enough that the rows with all-positive x pick this column ...
    w[:, 7] = w[:, n - 3] = w[:, 40]  # ... tied with two others in every row: ties go to the least index
    w = jnp.asarray(w, jnp.float32)
    x = rng.standard_normal((rows, k))
    x[::2] = np.abs(x[::2])  # even rows pick the tie, odd rows anything
    x = jnp.asarray(x, jnp.float32)
    logits, argmax, best = jax.jit(f32_matmul.f32_logits_argmax)(x, f32_matmul.pack_columns(w))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(_want(x, w)), rtol=1e-5, atol=1e-4)
    assert argmax.dtype == jnp.int32 and best.dtype == jnp.float32 and argmax.shape == best.shape == (rows,)
    np.testing.assert_array_equal(np.asarray(argmax), np.asarray(first_max(logits)))
    np.testing.assert_array_equal(np.asarray(best), np.asarray(jnp.max(logits, axis=-1)))
    assert (np.asarray(argmax) == 7).any()  # the tie was exercised


def test_the_runner_packs_f32_layers_and_head_on_cpu(tiny_llama):
    from paged_jax.entrypoints.llm import LLM
    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              seq_buckets=(2,), token_buckets=(16,), num_blocks=16, block_size=8)
    runner = llm.engine.core.runner
    assert runner.weight_layout == ("f32_columns" if HAS_AVX512 else "in_out")
    h, q, v = tiny_llama.config.hidden_size, tiny_llama.config.q_size, tiny_llama.config.vocab_size
    wq = runner.params["layers"][0]["wq"]  # the CPU runner unrolls: per-layer dicts
    assert wq.shape == ((q // 16, h, 16) if HAS_AVX512 else (h, q))
    assert (runner.packed_head.shape == (v // 16, h, 16)) if HAS_AVX512 else runner.packed_head is None
