"""f32 matmuls on AVX-512 FMAs (f32_matmul.cc says why).

`f32_matmul_many(x, w...)` is x @ W_i for one x and 1 to 4 weights (q, k, v) in one call;
`f32_matmul(x, w)` one of them; `f32_swiglu(x, gate, up)` is silu(x @ gate) * (x @ up);
`f32_logits_argmax(x, head)` is the LM head's logits with each row's greedy token and its
logit. Weights are f32 [K, N] as the checkpoint holds them (read in place), or
`pack_columns(w)` (each 16-column block's rows contiguous), the layout the serving runner
packs once at load: faster than [K, N] for the wide gate/up/down products, and then used at
every row count (`python -m experiments.weight_layout --dtypes=float32`). `supported()`
is True only where the kernels build with AVX-512; `fits(w)` where N % 16 == 0.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp

from cpu_kernels import build


@functools.cache
def supported() -> bool:
    if "avx512f" not in build._cpu_flags() or not build.available():
        return False
    library = ctypes.cdll.LoadLibrary(build.library_path())
    return bool(library.paged_jax_f32_matmul_supported())


def fits(w) -> bool:
    return w.ndim == 2 and w.shape[1] % 16 == 0


def pack_columns(w):
    """W [K, N] -> f32[N / 16, K, 16], packed[j, k, c] = W[k, 16 j + c]."""
    if not fits(w):
        raise ValueError(f"column packing needs W [K, N] with N % 16 == 0, got {w.shape}")
    k, n = w.shape
    return jnp.asarray(w, jnp.float32).reshape(k, n // 16, 16).transpose(1, 0, 2)


def columns(w) -> int:
    """N of a [K, N] or packed [N / 16, K, 16] weight."""
    return w.shape[1] if w.ndim == 2 else w.shape[0] * 16


def _rows(x, weights):
    k = x.shape[-1]
    for w in weights:
        if w.dtype != jnp.float32 or not ((w.ndim == 2 and w.shape[0] == k and w.shape[1] % 16 == 0)
                                          or (w.ndim == 3 and w.shape[1:] == (k, 16))):
            raise ValueError(f"x [..., {k}] takes f32 weights [{k}, N] (N % 16 == 0) or [N / 16, {k}, 16], "
                             f"got {w.dtype} {w.shape}")
    build.register()
    return x.reshape(-1, k).astype(jnp.float32)


def f32_matmul_many(x, *weights):
    """x [..., K] @ W_i -> a tuple of f32[..., N_i], one per weight (1 to 4), in one call."""
    if not 1 <= len(weights) <= 4:
        raise ValueError(f"f32_matmul_many takes 1 to 4 weights, got {len(weights)}")
    rows = _rows(x, weights)
    shapes = [jax.ShapeDtypeStruct((rows.shape[0], columns(w)), jnp.float32) for w in weights]
    outs = jax.ffi.ffi_call("paged_jax_f32_matmul", shapes, vmap_method="sequential")(rows, *weights)
    return tuple(out.reshape(*x.shape[:-1], out.shape[1]) for out in outs)


def f32_matmul(x, w):
    """x [..., K] @ W -> f32[..., N]."""
    return f32_matmul_many(x, w)[0]


def f32_swiglu(x, gate, up):
    """silu(x [..., K] @ W_gate) * (x @ W_up) -> f32[..., N], for gate and up of one shape."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {gate.shape}, {up.shape}")
    rows = _rows(x, (gate, up))
    shape = jax.ShapeDtypeStruct((rows.shape[0], columns(gate)), jnp.float32)
    out = jax.ffi.ffi_call("paged_jax_f32_swiglu", shape, vmap_method="sequential")(rows, gate, up)
    return out.reshape(*x.shape[:-1], out.shape[1])


def f32_logits_argmax(x, head):
    """x [M, K] @ W -> (logits f32[M, N], argmax i32[M], best f32[M]): argmax is the first
    index of each row's largest logit (what `jnp.argmax` returns) and best that logit,
    taken from the logits as the kernel stores them."""
    if x.ndim != 2:
        raise ValueError(f"f32_logits_argmax takes x [M, K], got {x.shape}")
    rows = _rows(x, (head,))
    m, n = rows.shape[0], columns(head)
    shapes = (jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.int32),
              jax.ShapeDtypeStruct((m,), jnp.float32))
    return jax.ffi.ffi_call("paged_jax_f32_logits_argmax", shapes, vmap_method="sequential")(rows, head)
