"""The NNX decoder modules: their state is the loaders' parameter layout, and they compute
what a hand calculation says."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from paged_jax.attention.dense_attention import DenseMetadata, dense_attention, init_dense_cache
from paged_jax.config.model_config import ModelConfig, RopeScaling
from paged_jax.model.decoder import DecoderLayer, LlamaDecoder
from paged_jax.model.functional import check_params, params_of, restack_layers, split_model, unstack_layers
from paged_jax.model.llama import init_params, param_shapes

PRESETS = ["tiny_llama", "tiny_llama_untied", "tiny_mistral", "tiny_qwen2", "tiny_qwen3", "smollm2_135m"]
# every switch at once: untied, q/k/v and o biases, q/k norms, llama3 RoPE scaling, a sliding window
ALL_SWITCHES = dataclasses.replace(
    configs.get_config("tiny_llama"), tie_word_embeddings=False, qkv_bias=True, o_bias=True, qk_norm=True,
    sliding_window=4, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16))


def _config(name):
    return ALL_SWITCHES if name == "all_switches" else configs.get_config(name)


def _shapes(tree):
    return jax.tree.map(lambda a: tuple(a.shape), tree)


@pytest.mark.parametrize("name", PRESETS + ["all_switches"])
def test_state_is_the_param_layout(name):
    """Same names, same nesting, same shapes as the loaders' dict: nothing to convert."""
    cfg = _config(name)
    _, abstract = split_model(LlamaDecoder, cfg)
    want = jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert _shapes(abstract) == want
    check_params(abstract, init_params(cfg, jax.random.key(0)) if cfg.num_layers < 4 else abstract)


def test_module_init_follows_the_layout_rule():
    """A live module's Params: the layout's dtypes and scales (norms near 1, matrices ~fan_in^-1/2)."""
    cfg = ALL_SWITCHES
    params = params_of(LlamaDecoder(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    assert _shapes(params) == jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    layers = jax.tree.map(lambda a: np.asarray(a, np.float32), params["layers"])
    assert abs(layers["attn_norm"].mean() - 1) < 0.05
    assert abs(layers["wq"].std() * cfg.hidden_size ** 0.5 - 1) < 0.1
    assert not np.array_equal(layers["wq"][0], layers["wq"][1]), "each layer draws its own weights"


def test_check_params_catches_what_merge_would_not():
    """nnx.merge fills leaves in sorted-name order: a renamed leaf would load into the wrong slot."""
    cfg = configs.get_config("tiny_llama")
    graphdef, abstract = split_model(LlamaDecoder, cfg)
    params = init_params(cfg, jax.random.key(0))
    renamed = {**params, "layers": {("w_gat" if k == "w_gate" else k): v for k, v in params["layers"].items()}}
    nnx.merge(graphdef, renamed)  # accepted: same number of leaves
    with pytest.raises(ValueError, match=r"missing \['layers/w_gate'\], unexpected \['layers/w_gat'\]"):
        check_params(abstract, renamed)
    short = {**params, "embed": params["embed"][:10]}
    with pytest.raises(ValueError, match=r"wrong shapes \['embed: \(10, 64\) \(model: \(256, 64\)\)'\]"):
        check_params(abstract, short)


def test_split_refuses_hidden_state():
    class Counting(LlamaDecoder):
        def __init__(self, cfg, *, rngs, dtype=jnp.float32):
            super().__init__(cfg, rngs=rngs, dtype=dtype)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    with pytest.raises(ValueError, match=r"state other than nnx.Param \(\['calls'\]\)"):
        split_model(Counting, configs.get_config("tiny_llama"))


def _logits(model_class, cfg, params, tokens):
    """All-position logits of `tokens` [B, T] through the dense cache."""
    graphdef, abstract = split_model(model_class, cfg)
    check_params(abstract, params)

    @jax.jit
    def run(params, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        cache = init_dense_cache(cfg, tokens.shape[0], tokens.shape[1], jnp.float32)
        model = nnx.merge(graphdef, params)
        attention = functools.partial(dense_attention, sliding_window=cfg.sliding_window)
        hidden, _ = model(tokens, positions, cache, DenseMetadata(positions, positions), attention)
        return model.compute_logits(hidden)

    return np.asarray(run(params, jnp.asarray(tokens, jnp.int32)))


TOKENS = np.array([[1, 5, 9, 33, 7, 100, 3, 4], [42, 2, 200, 17, 9, 9, 1, 8]])


class _Unrolled(LlamaDecoder):
    """The layers applied one by one in Python, each on its own slice of the stacked state."""

    def __call__(self, token_ids, positions, kv_cache, metadata, attention_fn):
        cfg = self.cfg
        x = self.embed[...][token_ids]
        from paged_jax.model.rope import inverse_frequencies, rope_cos_sin
        cos, sin = rope_cos_sin(positions, inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        layer_def, state = nnx.split(self.layers)
        for i in range(cfg.num_layers):
            layer = nnx.merge(layer_def, jax.tree.map(lambda a: a[i], state))
            x, kv_cache = layer(x, cos, sin, kv_cache, jnp.int32(i), metadata, attention_fn)
        return self.norm(x, self.final_norm), kv_cache


@pytest.mark.parametrize("name", ["tiny_llama", "all_switches"])
def test_scan_equals_layers_one_by_one(name):
    cfg = dataclasses.replace(_config(name), num_layers=3)
    params = init_params(cfg, jax.random.key(4))
    np.testing.assert_allclose(_logits(LlamaDecoder, cfg, params, TOKENS), _logits(_Unrolled, cfg, params, TOKENS),
                               rtol=1e-5, atol=1e-5)


def test_unrolled_serving_layout_equals_the_scan():
    """The runner's CPU layout: per-layer arrays (unstack_layers), restacked inside jit and
    run with unroll_layers=True, gives the scan's logits."""
    cfg = dataclasses.replace(_config("all_switches"), num_layers=3)
    params = init_params(cfg, jax.random.key(5))
    graphdef, _ = split_model(LlamaDecoder, cfg)
    per_layer = unstack_layers(params)
    assert len(per_layer["layers"]) == 3 and per_layer["layers"][1]["wq"].shape == params["layers"]["wq"].shape[1:]

    @jax.jit
    def run(per_layer, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        cache = init_dense_cache(cfg, tokens.shape[0], tokens.shape[1], jnp.float32)
        model = nnx.merge(graphdef, restack_layers(per_layer))
        attention = functools.partial(dense_attention, sliding_window=cfg.sliding_window)
        hidden, _ = model(tokens, positions, cache, DenseMetadata(positions, positions), attention, unroll_layers=True)
        return model.compute_logits(hidden)

    np.testing.assert_allclose(np.asarray(run(per_layer, jnp.asarray(TOKENS, jnp.int32))),
                               _logits(LlamaDecoder, cfg, params, TOKENS), rtol=1e-5, atol=1e-5)


def test_one_layer_by_hand():
    """One layer, head_dim 2, q = k = 0 (every score equal: attention is the running mean of
    v), v and o the identity, no MLP (w_down = 0), norms 1, tied head.

    Token 0, embedding [1, 0]: normed h0 = [r, 0] with r = sqrt(2); attention = h0;
    x = [1 + r, 0]; final norm -> [r, 0]; logits = embed @ [r, 0] = [r, 0, r, -r].
    Token 1, embedding [0, 1]: h1 = [0, r]; attention = (h0 + h1) / 2 = [r/2, r/2];
    x = [r/2, 1 + r/2]; final norm -> x / rms(x); logits = embed @ that.
    """
    cfg = ModelConfig(architecture="llama", vocab_size=4, hidden_size=2, intermediate_size=1, num_layers=1,
                      num_heads=1, num_kv_heads=1, rms_norm_eps=1e-12, tie_word_embeddings=True)
    embed = np.array([[1, 0], [0, 1], [1, 1], [-1, 0]], np.float32)
    eye, zeros = np.eye(2, dtype=np.float32)[None], np.zeros((1, 2, 2), np.float32)
    params = {"embed": embed, "final_norm": np.ones(2, np.float32), "layers": {
        "attn_norm": np.ones((1, 2), np.float32), "mlp_norm": np.ones((1, 2), np.float32),
        "wq": zeros, "wk": zeros, "wv": eye, "wo": eye, "w_gate": np.ones((1, 2, 1), np.float32),
        "w_up": np.ones((1, 2, 1), np.float32), "w_down": np.zeros((1, 1, 2), np.float32)}}
    logits = _logits(LlamaDecoder, cfg, params, [[0, 1]])[0]
    r = np.sqrt(2)
    x1 = np.array([r / 2, 1 + r / 2])
    h1 = x1 / np.sqrt(np.mean(x1 ** 2))
    np.testing.assert_allclose(logits, [[r, 0, r, -r], embed @ h1], rtol=1e-6, atol=1e-6)


def test_swiglu_by_hand():
    """x = [1, 0]; gate = x @ [[1], [0]] = 1, up = x @ [[2], [0]] = 2; silu(1) * 2 = 2 / (1 + e^-1);
    down [[1, -1]] -> [2 / (1 + e^-1), -2 / (1 + e^-1)]."""
    cfg = ModelConfig(architecture="llama", vocab_size=4, hidden_size=2, intermediate_size=1, num_layers=1,
                      num_heads=1, num_kv_heads=1)
    layer = DecoderLayer(cfg, rngs=nnx.Rngs(0))
    layer.w_gate[...] = jnp.array([[1.0], [0.0]])
    layer.w_up[...] = jnp.array([[2.0], [0.0]])
    layer.w_down[...] = jnp.array([[1.0, -1.0]])
    want = 2 / (1 + np.exp(-1))
    np.testing.assert_allclose(layer.mlp(jnp.array([1.0, 0.0])), [want, -want], rtol=1e-6)
