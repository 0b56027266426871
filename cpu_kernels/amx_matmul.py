"""bf16 matmuls on Intel AMX with weights packed once (amx_matmul.cc says why).

`pack_weights(w)` turns a [K, N] weight matrix into the tile layout the kernel reads
(bf16[N / 16, K / 32, 16, 32]); `amx_matmul(x, packed)` is x @ w accumulated in f32, for x
of any float dtype and leading shape; `amx_matmul_many(x, packed...)` is several products of
one x in one call (q, k, v); `amx_swiglu(x, gate, up)` is silu(x @ gate) * (x @ up) rounded
to bf16, the MLP's first half in one call; `amx_logits_argmax(x, head)` is the LM head's
logits with each row's greedy token and its logit taken as the tiles are stored. `supported()` is True only where the kernels build
with AMX, the CPU has it and the OS grants the tile state; `packable(w)` where the shape
fits the tiles (K % 32 == 0, N % 16 == 0).
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build


@functools.cache
def supported() -> bool:
    if "amx_bf16" not in build._cpu_flags() or not build.available():
        return False
    library = ctypes.cdll.LoadLibrary(build.library_path())
    return bool(library.paged_jax_amx_matmul_supported())


def packable(w) -> bool:
    return w.ndim == 2 and w.shape[0] % 32 == 0 and w.shape[1] % 16 == 0


def pack_weights(w):
    """W [K, N] -> bf16[N / 16, K / 32, 16, 32] with packed[nb, kb, r, 2c + p] = W[32 kb + 2r + p, 16 nb + c]:
    16-column B tiles, each 32 K rows as 16 rows of interleaved pairs."""
    if not packable(w):
        raise ValueError(f"AMX packing needs W [K, N] with K % 32 == 0 and N % 16 == 0, got {w.shape}")
    k, n = w.shape
    tiles = jnp.asarray(w, jnp.bfloat16).reshape(k // 32, 16, 2, n // 16, 16)  # [kb, r, p, nb, c]
    return tiles.transpose(3, 0, 1, 4, 2).reshape(n // 16, k // 32, 16, 32)


def _rows(x, packed):
    """x [..., K] as bf16 rows [M padded to 16, K], checked against the packed weights."""
    for w in packed:
        nb, kb, r, c = w.shape
        if (r, c) != (16, 32) or x.shape[-1] != kb * 32 or w.dtype != jnp.bfloat16:
            raise ValueError(f"x [..., {kb * 32}] and packed bf16 [N/16, K/32, 16, 32], got {x.shape}, {w.shape}")
    build.register()
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16)
    m = rows.shape[0]
    padded = -(-m // 16) * 16
    if padded != m:
        rows = jnp.pad(rows, ((0, padded - m), (0, 0)))
    return rows, m


def amx_matmul_many(x, *packed):
    """x [..., K] @ W_i -> a tuple of f32[..., N_i], one per `pack_weights(W_i)` (1 to 4), in one
    call; x is rounded to bf16."""
    if not 1 <= len(packed) <= 4:
        raise ValueError(f"amx_matmul_many takes 1 to 4 packed weights, got {len(packed)}")
    rows, m = _rows(x, packed)
    shapes = [jax.ShapeDtypeStruct((rows.shape[0], w.shape[0] * 16), jnp.float32) for w in packed]
    outs = jax.ffi.ffi_call("paged_jax_amx_matmul_bf16", shapes, vmap_method="sequential")(rows, *packed)
    return tuple(out[:m].reshape(*x.shape[:-1], out.shape[1]) for out in outs)


def amx_matmul(x, packed):
    """x [..., K] @ W -> f32[..., N] for `packed = pack_weights(W)`; x is rounded to bf16."""
    return amx_matmul_many(x, packed)[0]


def amx_swiglu(x, gate, up):
    """silu(x [..., K] @ W_gate) * (x @ W_up) -> bf16[..., N], for `gate`, `up` =
    pack_weights of two [K, N] matrices: the products stay f32 inside the kernel and are
    rounded to bf16 once (what the down projection reads). x is rounded to bf16."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must be packed from matrices of one shape, got {gate.shape}, {up.shape}")
    rows, m = _rows(x, (gate, up))
    shape = jax.ShapeDtypeStruct((rows.shape[0], gate.shape[0] * 16), jnp.bfloat16)
    out = jax.ffi.ffi_call("paged_jax_amx_swiglu_bf16", shape, vmap_method="sequential")(rows, gate, up)
    return out[:m].reshape(*x.shape[:-1], out.shape[1])


def amx_logits_argmax(x, packed):
    """x [M, K] @ W -> (logits f32[M, N], argmax i32[M], best f32[M]) for `packed =
    pack_weights(W)`: argmax is the first index of each row's largest logit (what
    `jnp.argmax` returns) and best that logit, computed in the kernel from the logits it
    stores, so a greedy step reads no [M, N] array again. x is rounded to bf16."""
    if x.ndim != 2:
        raise ValueError(f"amx_logits_argmax takes x [M, K], got {x.shape}")
    rows, m = _rows(x, (packed,))
    padded, n = rows.shape[0], packed.shape[0] * 16
    shapes = (jax.ShapeDtypeStruct((padded, n), jnp.float32), jax.ShapeDtypeStruct((padded,), jnp.int32),
              jax.ShapeDtypeStruct((padded,), jnp.float32))
    logits, argmax, best = jax.ffi.ffi_call("paged_jax_amx_logits_argmax_bf16", shapes,
                                            vmap_method="sequential")(rows, packed)
    return logits[:m], argmax[:m], best[:m]
