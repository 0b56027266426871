"""The CPU's weight layouts for the decoder's matmuls (paged_jax/model/linear.py's contract).

Why each exists (`python -m experiments.weight_layout` is the record):
- XLA's CPU dot repacks bf16 weights for AMX on every call, which in a 64-row SmolLM2 decode
  step cost about as much as the matmuls. Holding them [out, in] (`OutInLinear`, PyTorch's
  Linear layout) is the cheaper repack: bf16 64-row dots 1.20x faster for gate/up, 1.67x
  for down; f32 gains nothing from [out, in].
- Packing once removes the repack (`AmxTilesLinear`, Intel AMX tiles multiplied by the
  native kernel, cpu_kernels/amx_matmul.cc): 1.06-1.63x over [out, in] at 64 and 1024 rows.
- f32 weights packed in 16-column blocks for the native AVX-512 FMA kernel
  (`F32ColumnsLinear`, cpu_kernels/f32_matmul.cc): SmolLM2's 64-row projections 1.10-1.38x
  faster than XLA's dot on [in, out], 0.89-1.10x at 1024 rows.
The native kernels also take q, k and v in one call (one wake-up of their threads instead
of three: a 64-row SmolLM2 decode step makes 60 fewer calls), fuse SwiGLU's product into
their epilogue, and multiply by a packed LM head while finding each row's argmax (XLA's dot
repacked the 49k x 576 embedding every step: ~10% of a 64-row decode step in a `perf` profile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import amx_matmul, f32_matmul
from paged_jax.model.linear import XlaLinear


class OutInLinear(XlaLinear):
    """XLA's dot on [out, in] matrices, contracted on their last axis (bf16 without AMX)."""

    name = "out_in"

    def dense(self, x, w):
        return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def pack(self, w):
        return jnp.swapaxes(w, -1, -2)


def _each_matrix(pack, w):
    """`pack` of a [K, N] matrix, or of each of a stack [layers, K, N]."""
    return pack(w) if w.ndim == 2 else jnp.stack([pack(m) for m in w])


class F32ColumnsLinear(XlaLinear):
    """f32 weights [N / 16, K, 16] on the AVX-512 FMA kernel."""

    name = "f32_columns"

    def dense(self, x, w):
        return f32_matmul.f32_matmul(x.astype(jnp.float32), w)

    def dense_many(self, x, *ws):
        return f32_matmul.f32_matmul_many(x.astype(jnp.float32), *ws)

    def swiglu(self, x, w_gate, w_up):
        return f32_matmul.f32_swiglu(x.astype(jnp.float32), w_gate, w_up)

    def pack(self, w):
        return _each_matrix(f32_matmul.pack_columns, w)

    def pack_head(self, head):
        return f32_matmul.pack_columns(head) if f32_matmul.fits(head) and head.dtype == jnp.float32 else None

    def head_logits(self, hidden, packed_head, *, argmax: bool):
        if argmax:
            return f32_matmul.f32_logits_argmax(hidden, packed_head)
        return f32_matmul.f32_matmul(hidden, packed_head)


class AmxTilesLinear(XlaLinear):
    """bf16 weights packed into AMX tiles on the native AMX kernel (SwiGLU's result in bf16,
    the dtype the down projection's kernel reads)."""

    name = "amx_tiles"

    def dense(self, x, w):
        return amx_matmul.amx_matmul(x, w)

    def dense_many(self, x, *ws):
        return amx_matmul.amx_matmul_many(x, *ws)

    def swiglu(self, x, w_gate, w_up):
        return amx_matmul.amx_swiglu(x, w_gate, w_up)

    def pack(self, w):
        return _each_matrix(amx_matmul.pack_weights, w)

    def pack_head(self, head):
        return amx_matmul.pack_weights(head) if amx_matmul.packable(head) else None

    def head_logits(self, hidden, packed_head, *, argmax: bool):
        if argmax:
            return amx_matmul.amx_logits_argmax(hidden, packed_head)
        return amx_matmul.amx_matmul(hidden, packed_head)


OUT_IN, F32_COLUMNS, AMX_TILES = OutInLinear(), F32ColumnsLinear(), AmxTilesLinear()
