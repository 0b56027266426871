"""Functional Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in JAX.

Parameters are a plain nested dict (a pytree) with every per-layer weight stacked on a
leading `num_layers` axis, so the decoder is one `lax.scan` over layers: one layer body
to compile instead of `num_layers`.

The KV cache and the attention metadata are explicit arguments and results. The model
never looks inside them: each layer hands its new q/k/v, the whole cache and its layer
index to an `attention_fn` that writes K/V into that layer's part of the cache and
attends, so the same model code runs on a dense contiguous cache
(`paged_jax.attention.dense_attention`) and on a paged cache read through block tables. The cache
rides in the scan's carry, not its xs/ys: XLA then updates it in place (a donated
multi-GB cache is never copied per step), and each layer scatters only its new K/V. Token ids may have any leading shape (`[batch, seq]` for the dense reference,
`[num_tokens]` for a flattened ragged batch); only `attention_fn` cares.

Parameter layout (L = num_layers, H = hidden_size, Q = num_heads * head_dim,
K = num_kv_heads * head_dim, I = intermediate_size, V = vocab_size, D = head_dim):

    embed        [V, H]
    final_norm   [H]
    lm_head      [H, V]           absent when tie_word_embeddings
    layers:
      attn_norm  [L, H]           mlp_norm [L, H]
      wq [L, H, Q]  wk [L, H, K]  wv [L, H, K]  wo [L, Q, H]
      bq [L, Q]  bk [L, K]  bv [L, K]         only when qkv_bias
      bo [L, H]                               only when o_bias
      q_norm [L, D]  k_norm [L, D]            only when qk_norm
      w_gate [L, H, I]  w_up [L, H, I]  w_down [L, I, H]
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from paged_jax.config.model_config import ModelConfig
from paged_jax.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

Params = dict[str, Any]
# (q [*tok, Hq, D], k [*tok, Hkv, D], v [*tok, Hkv, D], kv_cache, layer i32[], metadata)
#   -> (out [*tok, Hq, D], kv_cache with layer `layer`'s new K/V written)
AttentionFn = Callable[..., tuple[jnp.ndarray, Any]]


def param_shapes(cfg: ModelConfig) -> Params:
    """The shape of every parameter, in the layout documented above."""
    L, H, I, V, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    Q, K = cfg.q_size, cfg.kv_size
    layers = {
        "attn_norm": (L, H), "mlp_norm": (L, H),
        "wq": (L, H, Q), "wk": (L, H, K), "wv": (L, H, K), "wo": (L, Q, H),
        "w_gate": (L, H, I), "w_up": (L, H, I), "w_down": (L, I, H),
    }
    if cfg.qkv_bias:
        layers.update(bq=(L, Q), bk=(L, K), bv=(L, K))
    if cfg.o_bias:
        layers.update(bo=(L, H))
    if cfg.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    shapes = {"embed": (V, H), "final_norm": (H,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, V)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random weights for tests and tiny models.

    Matrices are normal with std fan_in ** -0.5 (variance-preserving), embeddings std
    hidden_size ** -0.5, norms around 1: the layers' outputs then dominate the residual
    stream, so a tied model does not just repeat its last token (as it does with 0.02).
    """
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            leaf = 1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)
        elif name == "embed":
            leaf = jax.random.normal(k, shape, jnp.float32) * shape[1] ** -0.5
        elif name in ("bq", "bk", "bv", "bo"):
            leaf = 0.1 * jax.random.normal(k, shape, jnp.float32)
        else:  # [..., fan_in, fan_out] matrices, lm_head included
            leaf = jax.random.normal(k, shape, jnp.float32) * shape[-2] ** -0.5
        leaves.append(leaf.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def _attention_block(cfg, lp, x, cos, sin, kv_cache, layer, metadata, attention_fn):
    tok_shape = x.shape[:-1]
    q = x @ lp["wq"]
    k = x @ lp["wk"]
    v = x @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(*tok_shape, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*tok_shape, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*tok_shape, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, kv_cache = attention_fn(q, k, v, kv_cache, layer, metadata)
    out = out.reshape(*tok_shape, cfg.q_size).astype(x.dtype) @ lp["wo"]
    if cfg.o_bias:
        out = out + lp["bo"]
    return out, kv_cache


def _mlp_block(lp, x):
    return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def forward(params: Params, cfg: ModelConfig, token_ids: jnp.ndarray, positions: jnp.ndarray,
            kv_cache: Any, metadata: Any, attention_fn: AttentionFn) -> tuple[jnp.ndarray, Any]:
    """Run the decoder over new tokens.

    token_ids, positions: i32[*tok]. kv_cache: any pytree (leaves with a leading
    `num_layers` axis by convention); `attention_fn` gets it with the layer index.
    Returns (hidden [*tok, hidden_size] after the final norm, the updated kv_cache).
    Logits are a separate step (`compute_logits`) so callers project only the rows
    they sample from.
    """
    x = params["embed"][token_ids]
    cos, sin = rope_cos_sin(positions, inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    def layer(carry, layer_inputs):
        x, kv_cache = carry
        lp, index = layer_inputs
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        attn, kv_cache = _attention_block(cfg, lp, h, cos, sin, kv_cache, index, metadata, attention_fn)
        x = x + attn
        x = x + _mlp_block(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps))
        return (x, kv_cache), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, kv_cache), _ = jax.lax.scan(layer, (x, kv_cache), (params["layers"], layers))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv_cache


def compute_logits(params: Params, hidden: jnp.ndarray) -> jnp.ndarray:
    """hidden [..., H] -> f32[..., vocab_size] (tied embeddings when there is no lm_head)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(hidden, head, preferred_element_type=jnp.float32)
