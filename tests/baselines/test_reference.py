"""The dense reference: hand-checked attention, then generate against a no-cache oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from paged_jax.attention.dense_attention import DenseMetadata, dense_attention
from paged_jax.baselines import reference
from paged_jax.model.llama import init_params
from tests.helpers.greedy_check import assert_greedy_match

# Three tokens, one head, head_dim 2, queries all zero: every allowed key scores 0, so each
# output is the plain mean of the values it may see. v = [1,0], [0,1], [3,3].
_V = jnp.array([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0]])


def _hand_attention(write_positions, sliding_window=None):
    q = jnp.zeros((1, 3, 1, 2))
    k = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])[None, :, None, :]
    cache = {"k": jnp.zeros((1, 1, 4, 1, 2)), "v": jnp.zeros((1, 1, 4, 1, 2))}  # one layer
    meta = DenseMetadata(positions=jnp.array([[0, 1, 2]]), write_positions=jnp.array([write_positions]))
    out, cache = dense_attention(q, k, _V[None, :, None, :], cache, 0, meta, sliding_window=sliding_window)
    return np.asarray(out[0, :, 0]), np.asarray(cache["v"][0, 0, :, 0])


def test_dense_attention_hand_case():
    out, v_cache = _hand_attention([0, 1, 2])
    # out0 = v0; out1 = (v0 + v1) / 2; out2 = (v0 + v1 + v2) / 3 = [4/3, 4/3]
    np.testing.assert_allclose(out, [[1, 0], [0.5, 0.5], [4 / 3, 4 / 3]], rtol=1e-6)
    np.testing.assert_allclose(v_cache, [[1, 0], [0, 1], [3, 3], [0, 0]])


def test_dense_attention_sliding_window():
    out, _ = _hand_attention([0, 1, 2], sliding_window=2)
    # window 2: position 2 sees keys 1 and 2 only -> (v1 + v2) / 2 = [1.5, 2]
    np.testing.assert_allclose(out, [[1, 0], [0.5, 0.5], [1.5, 2.0]], rtol=1e-6)


def test_dense_attention_padding_writes_nothing():
    out, v_cache = _hand_attention([0, 1, 4])  # index 4 is past the cache: dropped
    # query 2 still sees index 2, which holds zeros: (v0 + v1 + 0) / 3
    np.testing.assert_allclose(out[2], [1 / 3, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(v_cache[2], [0, 0])


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_mistral", "tiny_qwen3"])
def model(request):
    cfg = configs.get_config(request.param)
    return cfg, init_params(cfg, jax.random.key(7))


PROMPTS = [[1, 5, 9, 33, 7], [1, 100], [1] + list(range(10, 50)), [42]]


def test_greedy_matches_no_cache_oracle(model):
    """Each new token equals the argmax of a full recompute over prompt + output so far."""
    cfg, params = model
    outs = reference.generate(params, cfg, PROMPTS, max_new_tokens=10, ignore_eos=True)
    last_logits = lambda ids: reference.prompt_logits(params, cfg, [ids])[0][-1]
    for prompt, out in zip(PROMPTS, outs):
        oracle = list(prompt)
        for _ in range(10):
            oracle.append(int(np.argmax(last_logits(oracle))))
        assert_greedy_match(prompt, oracle[len(prompt):], out, last_logits)
    assert len({tuple(o) for o in outs}) > 1, "degenerate model: every row generated the same"


def test_batch_composition_does_not_change_rows(model):
    cfg, params = model
    kw = dict(max_new_tokens=8, ignore_eos=True, temperature=[0.0, 0.9, 0.0, 1.2], seeds=[3, 4, 5, 6])
    together = reference.generate(params, cfg, PROMPTS, **kw)
    for row in range(len(PROMPTS)):
        alone = reference.generate(params, cfg, [PROMPTS[row]], max_new_tokens=8, ignore_eos=True,
                                   temperature=kw["temperature"][row], seeds=kw["seeds"][row])
        assert alone[0] == together[row]


def test_seeds_make_sampling_reproducible(model):
    cfg, params = model
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0)
    a = reference.generate(params, cfg, PROMPTS[:2], seeds=[1, 2], **kw)
    b = reference.generate(params, cfg, PROMPTS[:2], seeds=[1, 2], **kw)
    c = reference.generate(params, cfg, PROMPTS[:2], seeds=[8, 9], **kw)
    assert a == b
    assert a != c


def test_stops_after_first_stop_token(model):
    cfg, params = model
    [free] = reference.generate(params, cfg, PROMPTS[:1], max_new_tokens=10, ignore_eos=True)
    stop = free[3]
    first = free.index(stop)
    [stopped] = reference.generate(params, cfg, PROMPTS[:1], max_new_tokens=10, stop_token_ids=[stop])
    assert stopped == free[: first + 1]


def test_bfloat16_tracks_float32():
    cfg = configs.get_config("tiny_llama")
    params = init_params(cfg, jax.random.key(0))
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    l32 = reference.prompt_logits(params, cfg, PROMPTS)
    l16 = reference.prompt_logits(params16, cfg, PROMPTS)
    for a, b in zip(l32, l16):
        assert b.dtype == np.float32  # logits always come back in float32
        scale = np.abs(a).max()
        assert np.abs(a - b).max() < 0.05 * scale


def test_bad_inputs():
    cfg = configs.get_config("tiny_llama")
    params = init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="outside"):
        reference.generate(params, cfg, [[1, cfg.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        reference.generate(params, cfg, [[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        reference.generate(params, cfg, [[1]], max_new_tokens=0)
