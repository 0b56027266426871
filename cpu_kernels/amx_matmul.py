"""bf16 matmuls on Intel AMX with weights packed once (amx_matmul.cc says why).

`pack_weights(w)` turns a [K, N] weight matrix into the tile layout the kernel reads
(bf16[N / 16, K / 32, 16, 32]); `amx_matmul(x, packed)` is x @ w accumulated in f32, for x
of any float dtype and leading shape. `supported()` is True only where the kernels build
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


def amx_matmul(x, packed):
    """x [..., K] @ W -> f32[..., N] for `packed = pack_weights(W)`; x is rounded to bf16."""
    nb, kb, r, c = packed.shape
    if (r, c) != (16, 32) or x.shape[-1] != kb * 32 or packed.dtype != jnp.bfloat16:
        raise ValueError(f"x [..., {kb * 32}] and packed bf16 [N/16, K/32, 16, 32], got {x.shape}, {packed.shape}")
    build.register()
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16)
    m = rows.shape[0]
    padded = -(-m // 16) * 16
    if padded != m:
        rows = jnp.pad(rows, ((0, padded - m), (0, 0)))
    call = jax.ffi.ffi_call("paged_jax_amx_matmul_bf16", jax.ShapeDtypeStruct((padded, nb * 16), jnp.float32),
                            vmap_method="sequential")
    return call(rows, packed)[:m].reshape(*lead, nb * 16)
