"""Linear: how the decoder multiplies by its weight matrices, handed to it explicitly.

The decoder never decides how a matmul runs. Every product with a layer's projection
matrices goes through the `Linear` object its caller passes in (`LlamaDecoder.__call__(...,
linear=...)`), so one module serves every platform: this file's `XlaLinear` (XLA's dot on
the checkpoint's [in, out] matrices, the default and what GPUs and TPUs run), and the CPU
platform's layouts (`paged_jax/platform/cpu_linear.py`: [out, in] for XLA CPU's bf16 dot,
matrices packed once for native AVX-512 / AMX kernels). A researcher's layer calls
`linear.dense(x, w)` where it would write `x @ w`, and runs unchanged on all of them.

A Linear also says how the weights must be held for it (`pack`, applied once when the
runner loads them: `paged_jax.model.functional.layer_matrices_as`) and may hold the LM head
in a layout of its own (`pack_head` / `head_logits`); the default keeps both as they are.

Precision: reduced precision lives in the weights and the KV cache only. x is cast to w's
dtype for the product, accumulated and returned in float32, and the residual stream stays
float32. On the CPUs this project measures (avx512_bf16) a bf16 x bf16 -> f32 dot ran
240-420 GFLOP/s against 150-217 for f32, while dots with bf16 *outputs* were the slowest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class XlaLinear:
    """XLA's dot on [in, out] matrices (the checkpoint layout): every platform's fallback,
    and the choice on GPU and TPU. Stateless; subclasses override what they run natively."""

    name = "in_out"  # the weight layout, as records and tests name it

    def dense(self, x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
        """x [..., in] @ w -> f32[..., out]."""
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)

    def dense_many(self, x: jnp.ndarray, *ws: jnp.ndarray) -> tuple[jnp.ndarray, ...]:
        """(dense(x, w) for w in ws): one call for q, k and v, which a native kernel can
        serve in one pass over x."""
        return tuple(self.dense(x, w) for w in ws)

    def swiglu(self, x: jnp.ndarray, w_gate: jnp.ndarray, w_up: jnp.ndarray) -> jnp.ndarray:
        """silu(x @ w_gate) * (x @ w_up), the SwiGLU MLP's first half, in float32."""
        return jax.nn.silu(self.dense(x, w_gate)) * self.dense(x, w_up)

    def pack(self, w: jnp.ndarray) -> jnp.ndarray:
        """A layer matrix [in, out] (or a stack [layers, in, out]) in the layout `dense`
        takes. The identity here."""
        return w

    def pack_head(self, head: jnp.ndarray):
        """The LM head [hidden, vocab] in a layout of this Linear's own, or None: the model's
        `compute_logits` then computes the logits as it likes."""
        del head
        return None

    def head_logits(self, hidden: jnp.ndarray, packed_head, *, argmax: bool):
        """Logits of hidden [rows, H] against `pack_head`'s result; with `argmax`, also each
        row's argmax and its logit (a native head kernel finds them while writing the
        logits). Only called where pack_head returned a head."""
        raise NotImplementedError(f"{type(self).__name__} packs no LM head")


XLA_LINEAR = XlaLinear()
