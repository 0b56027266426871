"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as Flax NNX modules.

Why NNX (not linen): an NNX module is an ordinary Python object that holds its own
`nnx.Param`s, so a variant is a plain subclass overriding a method, and `nnx.split` /
`nnx.merge` turn a module into (a static `GraphDef`, a pytree of arrays) and back for
free. The serving step stays a pure jitted function of (params, KV cache, batch): it
merges the params into a module while tracing, calls it, and writes nothing back. Linen
would need an `init`/`apply` pair with `{"params": ...}` wrapping around every call; NNX
is also what tpu-inference's models are written in.

The state is the parameter pytree. A module's Params, as a pure dict
(`nnx.to_pure_dict(nnx.state(model, nnx.Param))`), have exactly the names, nesting and
shapes of the layout in `paged_jax.model.llama` that the loaders build. So
`nnx.merge(graphdef, params)` needs no converter, and loaders, checkpoints and tensor
parallelism (which shards by these names) never see a module. For that, a layer's
Params sit flat on `DecoderLayer` (not in per-block submodules, which would nest them
one level deeper than the loaders' `layers` dict); its parts are methods, the seams a
variant overrides (`norm`, `attention`, `init_mlp` + `mlp`).

The layer stack is one `DecoderLayer` built under `nnx.vmap`, so each of its Params
carries a leading `num_layers` axis, and the forward pass is one `lax.scan` over that
stacked state: one layer body to compile instead of `num_layers`. The KV cache and the
attention metadata are explicit arguments and results, never module state: each layer
hands its new q/k/v, the whole cache and its layer index to an `attention_fn` that
writes K/V into that layer's part of the cache and attends, so the same module runs on
a dense cache (`paged_jax.attention.dense_attention`) and on a paged one. The cache rides
in the scan's carry, so XLA updates a donated cache in place. Token ids may have any
leading shape (`[batch, seq]` for the dense reference, `[num_tokens]` for a ragged
batch); only `attention_fn` cares. Likewise every product with a weight matrix goes
through a `linear` argument (paged_jax/model/linear.py): the caller (the platform layer,
through the runner) decides how matmuls run and how the weights are laid out for them,
so nothing in this file knows which machine it runs on.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.config.model_config import ModelConfig
from paged_jax.model.linear import XLA_LINEAR, XlaLinear
from paged_jax.model.llama import init_leaf
from paged_jax.model.rope import apply_rope, inverse_frequencies, lookup_cos_sin, rope_cos_sin

# (q [*tok, Hq, D], k [*tok, Hkv, D], v [*tok, Hkv, D], kv_cache, layer i32[], metadata)
#   -> (out [*tok, Hq, D], kv_cache with layer `layer`'s new K/V written)
AttentionFn = Callable[..., tuple[jnp.ndarray, Any]]


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def new_param(name: str, shape: tuple, rngs: nnx.Rngs, dtype) -> nnx.Param:
    """A Param initialised by the layout's rule for `name` (the same as `init_params`)."""
    return nnx.Param(init_leaf(name, rngs.params(), shape, dtype))


class DecoderLayer(nnx.Module):
    """One pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)).

    Attention is grouped-query (num_heads query heads over num_kv_heads K/V heads; the
    grouping itself happens in `attention_fn`), with optional q/k/v and o biases, Qwen3's
    RMSNorm over head_dim on q and k before RoPE, and the config's sliding window applied
    by `attention_fn`. The MLP is SwiGLU.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        H, Q, K, D = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
        self.attn_norm = new_param("attn_norm", (H,), rngs, dtype)
        self.mlp_norm = new_param("mlp_norm", (H,), rngs, dtype)
        self.wq = new_param("wq", (H, Q), rngs, dtype)
        self.wk = new_param("wk", (H, K), rngs, dtype)
        self.wv = new_param("wv", (H, K), rngs, dtype)
        self.wo = new_param("wo", (Q, H), rngs, dtype)
        if cfg.qkv_bias:
            self.bq = new_param("bq", (Q,), rngs, dtype)
            self.bk = new_param("bk", (K,), rngs, dtype)
            self.bv = new_param("bv", (K,), rngs, dtype)
        if cfg.o_bias:
            self.bo = new_param("bo", (H,), rngs, dtype)
        if cfg.qk_norm:
            self.q_norm = new_param("q_norm", (D,), rngs, dtype)
            self.k_norm = new_param("k_norm", (D,), rngs, dtype)
        self.init_mlp(rngs, dtype)

    def init_mlp(self, rngs: nnx.Rngs, dtype) -> None:
        """The MLP's parameters (SwiGLU: w_gate, w_up [H, I], w_down [I, H])."""
        H, I = self.cfg.hidden_size, self.cfg.intermediate_size
        self.w_gate = new_param("w_gate", (H, I), rngs, dtype)
        self.w_up = new_param("w_up", (H, I), rngs, dtype)
        self.w_down = new_param("w_down", (I, H), rngs, dtype)

    def norm(self, x: jnp.ndarray, weight: nnx.Param) -> jnp.ndarray:
        return rms_norm(x, weight[...], self.cfg.rms_norm_eps)

    def mlp(self, x: jnp.ndarray, linear: XlaLinear = XLA_LINEAR) -> jnp.ndarray:
        return linear.dense(linear.swiglu(x, self.w_gate[...], self.w_up[...]), self.w_down[...])

    def attention(self, x, cos, sin, kv_cache, layer, metadata, attention_fn: AttentionFn,
                  linear: XlaLinear = XLA_LINEAR):
        """Project, rotate, attend through `attention_fn` (which writes this layer's K/V), project back."""
        cfg = self.cfg
        tok_shape = x.shape[:-1]
        q, k, v = linear.dense_many(x, self.wq[...], self.wk[...], self.wv[...])
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = q.reshape(*tok_shape, cfg.num_heads, cfg.head_dim)
        k = k.reshape(*tok_shape, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(*tok_shape, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = attention_fn(q, k, v, kv_cache, layer, metadata)
        out = linear.dense(out.reshape(*tok_shape, cfg.q_size), self.wo[...])
        if cfg.o_bias:
            out = out + self.bo[...]
        return out, kv_cache

    def __call__(self, x, cos, sin, kv_cache, layer, metadata, attention_fn: AttentionFn,
                 linear: XlaLinear = XLA_LINEAR):
        """x [*tok, H] -> (x after this layer, kv_cache with this layer's K/V written)."""
        attn, kv_cache = self.attention(self.norm(x, self.attn_norm), cos, sin, kv_cache, layer, metadata,
                                        attention_fn, linear)
        x = x + attn
        return x + self.mlp(self.norm(x, self.mlp_norm), linear), kv_cache


class LlamaDecoder(nnx.Module):
    """Embedding, `num_layers` stacked `layer_class` layers, final norm, and the LM head
    (the embedding matrix itself when `tie_word_embeddings`).

    A variant sets `layer_class` to a `DecoderLayer` subclass (and overrides `norm` if it
    changes the final norm too); its constructor must take (cfg, *, rngs, dtype).
    """

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        self.embed = new_param("embed", (V, H), rngs, dtype)
        self.final_norm = new_param("final_norm", (H,), rngs, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else new_param("lm_head", (H, V), rngs, dtype)
        layer_class = self.layer_class

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(layer_rngs):
            return layer_class(cfg, rngs=layer_rngs, dtype=dtype)

        self.layers = stacked(rngs)  # every Param with a leading num_layers axis

    def norm(self, x: jnp.ndarray, weight: nnx.Param) -> jnp.ndarray:
        return rms_norm(x, weight[...], self.cfg.rms_norm_eps)

    def __call__(self, token_ids, positions, kv_cache, metadata, attention_fn: AttentionFn, *,
                 linear: XlaLinear = XLA_LINEAR, unroll_layers: bool = False,
                 rope_tables: jnp.ndarray | None = None):
        """Run the decoder over new tokens.

        token_ids, positions: i32[*tok]. kv_cache: any pytree (leaves with a leading
        `num_layers` axis by convention); `attention_fn` gets it with the layer index.
        Returns (hidden [*tok, hidden_size] after the final norm, the updated kv_cache).
        Logits are a separate step (`compute_logits`) so callers project only the rows
        they sample from.

        linear: how the layers multiply by their matrices (paged_jax/model/linear.py), in the
        layout the params were packed for; the platform layer picks it, XLA's dot by default.

        unroll_layers: a Python loop over the layers (static slices of the stacked
        params, a Python int layer index) instead of `lax.scan`. It compiles num_layers
        bodies, but on XLA CPU a dot whose weights are a slice of a stacked array inside a
        loop misses the fast bf16 path: SmolLM2 in bf16 without attention took 147 ms per
        8-row step under the loop against 25 ms unrolled over per-layer arrays
        (`python -m experiments.step_profile --dtype=bfloat16`;
        `paged_jax.model.functional.unstack_layers` keeps them apart, the slices of their
        restacking fold away).

        rope_tables: f32[2, positions, head_dim] from `rope.rope_tables` (the runner's,
        covering max_model_len) to gather cos/sin from instead of computing them in the graph,
        where XLA would recompute them in every layer.
        """
        cfg = self.cfg
        x = self.embed[...][token_ids].astype(jnp.float32)  # the residual stream is float32 (linear.py)
        if rope_tables is not None:
            cos, sin = lookup_cos_sin(rope_tables, positions)
        else:
            cos, sin = rope_cos_sin(positions, inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        layer_def, layer_state = nnx.split(self.layers)

        def one_layer(carry, inputs):
            x, kv_cache = carry
            state, index = inputs
            x, kv_cache = nnx.merge(layer_def, state)(x, cos, sin, kv_cache, index, metadata, attention_fn, linear)
            return (x, kv_cache), None

        if unroll_layers:
            for index in range(cfg.num_layers):
                state = jax.tree.map(lambda a: a[index], layer_state)
                (x, kv_cache), _ = one_layer((x, kv_cache), (state, index))
            return self.norm(x, self.final_norm), kv_cache
        indices = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv_cache), _ = jax.lax.scan(one_layer, (x, kv_cache), (layer_state, indices))
        return self.norm(x, self.final_norm), kv_cache

    def compute_logits(self, hidden: jnp.ndarray) -> jnp.ndarray:
        """hidden [..., H] -> f32[..., vocab_size].

        Tied embeddings [V, H] contract on their H axis directly (dot_general), not through
        `embed.T`: on XLA CPU a bf16 dot against the transposed view ran 52 ms for 8 rows
        of SmolLM2 against 3.5 ms as one dot_general (f32: 10 vs 16 ms, so f32 keeps the
        transpose; a one-off measurement, not a committed record)."""
        if self.lm_head is not None:
            return XLA_LINEAR.dense(hidden, self.lm_head[...])
        embed = self.embed[...]
        if embed.dtype == jnp.float32:
            return XLA_LINEAR.dense(hidden, embed.T)
        return jax.lax.dot_general(hidden.astype(embed.dtype), embed, (((hidden.ndim - 1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
