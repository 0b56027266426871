"""The AMX matmul (cpu_kernels/amx_matmul.cc) against XLA's dot, its weight packing against
its formula, and the runner's choice of serving weight layout.

On a machine without AMX the kernel tests assert that the CPU indeed lacks it (so a build
that silently lost AMX on an AMX machine fails here) and the runner tests check the
fallback layout instead.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import amx_matmul, build

HAS_AMX_CPU = "amx_bf16" in build._cpu_flags() and "amx_tile" in build._cpu_flags()


def test_packing_follows_the_tile_formula():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    packed = np.asarray(amx_matmul.pack_weights(w), np.float32)
    w32 = np.asarray(w, np.float32)
    assert packed.shape == (3, 2, 16, 32)
    for nb, kb, r, c, p in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 1, 5, 7, 1), (2, 1, 15, 15, 0), (2, 0, 3, 9, 1)]:
        assert packed[nb, kb, r, 2 * c + p] == w32[32 * kb + 2 * r + p, 16 * nb + c]
    assert sorted(packed.ravel()) == sorted(w32.ravel())  # a permutation: nothing lost or repeated


def test_shapes_that_do_not_fit_the_tiles_are_refused():
    assert not amx_matmul.packable(jnp.zeros((48, 32)))  # K % 32
    assert not amx_matmul.packable(jnp.zeros((64, 24)))  # N % 16
    with pytest.raises(ValueError, match="K % 32"):
        amx_matmul.pack_weights(jnp.zeros((48, 32)))


def test_supported_exactly_where_the_cpu_has_amx():
    assert amx_matmul.supported() == HAS_AMX_CPU


@pytest.mark.parametrize("rows,k,n", [(1, 64, 16), (37, 576, 192), (64, 1536, 48), (3 * 16, 32, 80), (300, 64, 48)])
def test_matches_xla_dot(rows, k, n):
    if not HAS_AMX_CPU:
        assert not amx_matmul.supported()
        return
    rng = np.random.default_rng(rows + k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, rows, k)), jnp.float32)  # leading dims, rows not a multiple of 16
    want = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    got = jax.jit(amx_matmul.amx_matmul)(x, amx_matmul.pack_weights(w))
    assert got.shape == want.shape and got.dtype == jnp.float32
    # both accumulate bf16 products in f32; only the summation order may differ
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_several_weights_in_one_call_match_xla_dots():
    if not HAS_AMX_CPU:
        assert not amx_matmul.supported()
        return
    rng = np.random.default_rng(3)
    # q, k, v-like widths; 208 columns is an odd number of 16-column blocks (a lone last block)
    ws = [jnp.asarray(rng.standard_normal((96, n)), jnp.bfloat16) for n in (64, 32, 208)]
    x = jnp.asarray(rng.standard_normal((3, 37, 96)), jnp.float32)
    got = jax.jit(amx_matmul.amx_matmul_many)(x, *[amx_matmul.pack_weights(w) for w in ws])
    assert len(got) == 3
    for w, out in zip(ws, got):
        want = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        assert out.shape == want.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-4 * np.sqrt(96))


@pytest.mark.parametrize("rows", [1, 45, 300])
def test_swiglu_matches_silu_of_gate_times_up_in_bf16(rows):
    if not HAS_AMX_CPU:
        assert not amx_matmul.supported()
        return
    rng = np.random.default_rng(rows)
    gate, up = (jnp.asarray(rng.standard_normal((64, 80)) * 0.3, jnp.bfloat16) for _ in range(2))
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
    got = jax.jit(amx_matmul.amx_swiglu)(x, amx_matmul.pack_weights(gate), amx_matmul.pack_weights(up))
    xb = x.astype(jnp.bfloat16)
    g = jnp.dot(xb, gate, preferred_element_type=jnp.float32)
    want = jax.nn.silu(g) * jnp.dot(xb, up, preferred_element_type=jnp.float32)
    assert got.shape == (rows, 80) and got.dtype == jnp.bfloat16
    assert float(jnp.min(g)) < -2 and float(jnp.max(g)) > 2  # both branches of the sigmoid ran
    # one rounding to bf16 of the same f32 value, up to the products' summation order and the
    # exp's last bits: at most one bf16 step (2**-8 relative) apart
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("rows,n", [(1, 48), (37, 208), (300, 96)])
def test_logits_argmax_is_the_first_max_of_the_logits_it_returns(rows, n):
    if not HAS_AMX_CPU:
        assert not amx_matmul.supported()
        return
    from paged_jax.worker.step_head import first_max
    rng = np.random.default_rng(rows + n)
    w = rng.standard_normal((64, n))
    w[:, 40] += 1.0  # large enough that the rows with all-positive x pick this column ...
    w[:, 7] = w[:, n - 3] = w[:, 40]  # ... tied with two others in every row: ties go to the least index
    w = jnp.asarray(w, jnp.bfloat16)
    x = rng.standard_normal((rows, 64))
    x[::2] = np.abs(x[::2])  # even rows pick the tie, odd rows anything
    x = jnp.asarray(x, jnp.float32)
    logits, argmax, best = jax.jit(amx_matmul.amx_logits_argmax)(x, amx_matmul.pack_weights(w))
    want = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-3)
    assert argmax.dtype == jnp.int32 and best.dtype == jnp.float32 and argmax.shape == best.shape == (rows,)
    np.testing.assert_array_equal(np.asarray(argmax), np.asarray(first_max(logits)))
    np.testing.assert_array_equal(np.asarray(best), np.asarray(jnp.max(logits, axis=-1)))
    assert (np.asarray(argmax) == 7).any()  # the tie was exercised


def test_swiglu_refuses_gate_and_up_of_different_shapes():
    gate = amx_matmul.pack_weights(jnp.zeros((64, 32), jnp.bfloat16))
    up = amx_matmul.pack_weights(jnp.zeros((64, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match="one shape"):
        amx_matmul.amx_swiglu(jnp.zeros((4, 64)), gate, up)


def _runner(model, **settings):
    from paged_jax.entrypoints.llm import LLM
    llm = LLM(model, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, seq_buckets=(2,),
              token_buckets=(16,), num_blocks=16, block_size=8, **settings)
    return llm.engine.core.runner


def test_the_runner_packs_bf16_layers_on_cpu(tiny_llama):
    bf16 = _runner(tiny_llama, dtype="bfloat16")
    assert bf16.weight_layout == ("amx_tiles" if HAS_AMX_CPU else "out_in")
    wq = bf16.params["layers"][0]["wq"]  # the CPU runner unrolls: per-layer dicts
    h, q = tiny_llama.config.hidden_size, tiny_llama.config.q_size
    assert wq.shape == ((q // 16, h // 32, 16, 32) if HAS_AMX_CPU else (q, h))
    v = tiny_llama.config.vocab_size  # the LM head packed too (its own copy)
    assert (bf16.packed_head.shape == (v // 16, h // 32, 16, 32)) if HAS_AMX_CPU else bf16.packed_head is None
    assert _runner(tiny_llama, dtype="float32").weight_layout != "amx_tiles"  # f32: test_f32_matmul.py


def test_layer_classes_with_their_own_projections_keep_the_checkpoint_layout(tiny_llama):
    from paged_jax.model.decoder import DecoderLayer, LlamaDecoder

    class OwnMlp(DecoderLayer):
        def mlp(self, x, linear):
            del linear  # multiplies its own way: the runner must keep the checkpoint layout
            return jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...]) @ self.w_down[...]

    class OwnMlpDecoder(LlamaDecoder):
        layer_class = OwnMlp

    model = dataclasses.replace(tiny_llama, model_class=OwnMlpDecoder)
    assert _runner(model, dtype="bfloat16").weight_layout == "in_out"


def test_greedy_batches_take_the_head_kernels_argmax_and_skip_the_head(tiny_llama):
    """All-greedy batches that ask for no logprobs take their tokens from the AMX head's
    argmax; they must be the tokens the head call would have chosen, and any batch that
    asks for logprobs or samples must still go through the head."""
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.llm import LLM

    llm = LLM(tiny_llama, dtype="bfloat16", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              seq_buckets=(2,), token_buckets=(16,), num_blocks=16, block_size=8)
    runner = llm.engine.core.runner
    assert (runner.packed_head is not None) == HAS_AMX_CPU
    head_calls = []
    original_head = runner._heads.run
    runner._heads.run = lambda logits, feed, batch: head_calls.append(1) or original_head(logits, feed, batch)
    prompts = [{"prompt_token_ids": [5, 9, 12, 40, 3]}, {"prompt_token_ids": [77, 2, 19]}]

    def run(**params):
        head_calls.clear()
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, **params), use_tqdm=False)
        return [o.outputs[0] for o in outs]

    native = run(temperature=0.0)
    assert (len(head_calls) == 0) == HAS_AMX_CPU  # no head call at all where the kernel's argmax serves
    with_logprobs = run(temperature=0.0, logprobs=0)
    assert head_calls  # logprobs asked: the head ran ...
    assert [o.token_ids for o in native] == [o.token_ids for o in with_logprobs]  # ... and chose the same tokens
    run(temperature=0.8, seed=1)
    assert head_calls  # sampled rows: the sampler
    runner._heads.native_greedy = lambda greedy, batch: None  # the head for everything
    assert [o.token_ids for o in run(temperature=0.0)] == [o.token_ids for o in native]
