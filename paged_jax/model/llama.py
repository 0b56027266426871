"""The Llama family's (Llama, Mistral, Qwen2, Qwen3) parameter pytree: layout, shapes, random init.

This plain nested dict is the one canonical form of a model's weights: every loader
builds it, checkpoints store it, tensor parallelism shards it by these names, and the
Flax NNX decoder (`paged_jax.model.decoder`) is built so that its nnx.Param state is
exactly this dict, so it is merged into the module as-is. Every per-layer weight is
stacked on a leading `num_layers` axis, so the decoder scans one layer body over
layers instead of compiling `num_layers` of them.

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

from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config.model_config import ModelConfig

Params = dict[str, Any]


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


def init_leaf(name: str, key: jax.Array, shape: tuple, dtype=jnp.float32) -> jnp.ndarray:
    """Random values for parameter `name` of this shape (with or without the layer axis).

    Matrices are normal with std fan_in ** -0.5 (variance-preserving), embeddings std
    hidden_size ** -0.5, norms around 1: the layers' outputs then dominate the residual
    stream, so a tied model does not just repeat its last token (as it does with 0.02).
    """
    if name.endswith("norm"):
        leaf = 1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)
    elif name == "embed":
        leaf = jax.random.normal(key, shape, jnp.float32) * shape[1] ** -0.5
    elif name in ("bq", "bk", "bv", "bo"):
        leaf = 0.1 * jax.random.normal(key, shape, jnp.float32)
    else:  # [..., fan_in, fan_out] matrices, lm_head included
        leaf = jax.random.normal(key, shape, jnp.float32) * shape[-2] ** -0.5
    return leaf.astype(dtype)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random weights for tests and tiny models (one key per parameter, by `init_leaf`)."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = [init_leaf(path[-1].key, k, shape, dtype) for (path, shape), k in zip(flat, keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
