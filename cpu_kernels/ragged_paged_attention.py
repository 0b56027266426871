"""Ragged paged attention on CPU, natively (C++ in ragged_paged_attention.cc, an XLA FFI call).

Same contract as `pallas_kernels.ragged_paged_attention_reference`, which it is tested
against: q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (float32 or
bfloat16); block_tables i32[S, max_blocks]; context_lens i32[S]; query_start_loc i32[S + 1].
Returns [T, Hq, D] in q's dtype; q goes in, and the output comes out, in the cache's dtype
(q rounded to it, as the engine's paged_attention does); scores, the softmax and the
weighted sum of values accumulate in f32 whatever the cache's dtype.
The call reads each K/V row straight from the cache through the block table, which no
XLA formulation on CPU does (they copy the gathered blocks first), and splits its work over
XLA's intra-op threads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build

_TARGET = {jnp.dtype(jnp.float32): "paged_jax_ragged_paged_attention_f32",
           jnp.dtype(jnp.bfloat16): "paged_jax_ragged_paged_attention_bf16"}


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                               sm_scale=None, sliding_window=None, soft_cap=None):
    """See the module docstring. sm_scale defaults to head_dim ** -0.5; sliding_window W
    keeps keys with position > query position - W; soft_cap c maps scores s to c tanh(s / c).
    Raises ValueError for shapes or dtypes the kernel does not take."""
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q [T, Hq, D] and equal k/v caches [blocks, block_size, Hkv, D], got {q.shape}, "
                         f"{k_cache.shape}, {v_cache.shape}")
    if k_cache.dtype not in _TARGET or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the CPU kernel takes float32 or bfloat16 caches, got {k_cache.dtype}/{v_cache.dtype}")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of KV heads {k_cache.shape[2]}, head dims equal")
    if q.shape[2] > 256 or k_cache.shape[1] > 256 or q.shape[1] // k_cache.shape[2] > 64:
        raise ValueError("the CPU kernel takes head_dim <= 256, block_size <= 256 and <= 64 query heads per KV head")
    if block_tables.ndim != 2 or context_lens.shape != block_tables.shape[:1] \
            or query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"block_tables [S, max_blocks], context_lens [S], query_start_loc [S + 1], got "
                         f"{block_tables.shape}, {context_lens.shape}, {query_start_loc.shape}")
    build.register()
    scale = q.shape[2] ** -0.5 if sm_scale is None else sm_scale
    call = jax.ffi.ffi_call(_TARGET[k_cache.dtype], jax.ShapeDtypeStruct(q.shape, k_cache.dtype),
                            vmap_method="sequential")
    # q and the output in the cache's dtype (what the engine passes): a bf16 cache's kernel
    # multiplies bf16 q exactly and reads and writes half the bytes of f32 (at a 2048-token
    # prefill step, 4.7 MB less of each per layer); the engine's next use of the output, the
    # o projection, rounds it to bf16 anyway when its weights are bf16
    out = call(q.astype(k_cache.dtype), k_cache, v_cache, block_tables.astype(jnp.int32),
               context_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
               sm_scale=np.float32(scale), sliding_window=np.int32(sliding_window or 0),
               soft_cap=np.float32(soft_cap or 0.0))
    return out.astype(q.dtype)
