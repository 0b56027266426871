"""A step's new K or V rows into the paged cache, in place, natively (write_kv.cc).

XLA's CPU scatter has no bf16 path: a write into a bf16 cache converted the whole cache to
f32 and back, which is why a CPU cache used to stay f32. This call writes only the step's
rows, in f32 or bf16, into the cache buffer XLA aliases to its result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels import build

_TARGET = {jnp.dtype(jnp.float32): "paged_jax_write_kv_f32", jnp.dtype(jnp.bfloat16): "paged_jax_write_kv_bf16"}


def write_kv(cache, rows, slots, layer):
    """cache [L, num_blocks, block_size, Hkv, D] (f32 or bf16) with rows [T, Hkv, D] written at
    layer `layer`'s slots i32[T] (block * block_size + offset; out of range: dropped, as
    padding). Same result as `cache.at[layer, slots // bs, slots % bs].set(rows, mode="drop")`,
    rows rounded to the cache's dtype."""
    if cache.ndim != 5 or rows.shape != (slots.shape[0], *cache.shape[3:]) or cache.dtype not in _TARGET:
        raise ValueError(f"cache [L, blocks, block_size, Hkv, D] in f32/bf16 and rows [T, Hkv, D], got "
                         f"{cache.shape} {cache.dtype}, {rows.shape}, slots {slots.shape}")
    build.register()
    call = jax.ffi.ffi_call(_TARGET[cache.dtype], jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(cache, rows.astype(jnp.float32), slots.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1))
