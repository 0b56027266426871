"""Paged attention for decode: one query token per sequence, K/V read through a block table.

Sequence i has context_lens[i] tokens in the paged cache; token t lives in physical block
block_tables[i, t // block_size] at row t % block_size. Its single query is the last
token (position context_lens[i] - 1) and attends to every cached token of the sequence
(or, with a sliding window W, to the last W of them). This is the decode step of the
paper's PagedAttention: the kernel walks the sequence's blocks one at a time with an
online softmax and never gathers the sequence's K/V into a contiguous array.

Where the pieces live. This file holds the contract: `paged_attention_reference`, pure
jnp (gather through the table, dense masked softmax), the ground truth and the ragged
reference with one query per sequence; and `paged_attention`, the jitted public
function, which checks shapes and picks a backend. Each kernel variant has a file of its
own, laid out kernel body, then its pallas_call wrapper:
  * paged_attention_gpu.py: `paged_attention_kernel`, one program per (sequence, kv
    head, split) computing the whole GQA group of query heads, a `lax.fori_loop` over
    its share of the sequence's used blocks only, a chunk of blocks per step
    (TritonTuning, triton_tuning.py; the splits are merged by log-sum-exp). It lowers
    to Triton on GPU (on an H200 72% of the memory bandwidth at 64 sequences x 4096
    tokens, 1.2-1.4x the time of dense attention over contiguous head-major K/V:
    experiments/gpu_check.sh) and runs in interpret mode on CPU,
    one block per step and one split, where this grid measured 1.2-1.4x a single
    looping program (SmolLM2 shapes, 2 cores) and its time does not grow with the cache
    size: CPU keeps the GPU kernel rather than a layout of its own. The online-softmax
    math both variants share lives there too.
  * paged_attention_tpu.py: `paged_attention_tpu_kernel`, Mosaic TPU: block tables and
    context lengths scalar-prefetched into SMEM, the cache left in HBM (`pl.ANY`), each
    block's K/V copied into a double-buffered VMEM scratch by async DMA while the
    previous block computes.

Invariants every variant keeps: keys at positions >= context_len (the tail of the last
block, table padding) are masked out of the scores *and* zeroed in the values, so unused
cache slots may hold anything, NaN included; a sequence with context_len 0 gets zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention_gpu import paged_attention_gpu_call
from pallas_kernels.paged_attention_tpu import paged_attention_tpu_call
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.triton_tuning import TritonTuning

_BACKENDS = ("cpu", "gpu", "cuda", "rocm", "tpu")


# ---------------------------------------------------------------------------- checks


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim]; got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q and the caches must be floating point; got {q.dtype}")
    num_seqs, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the cache's {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq]; "
                         f"got {block_tables.shape}")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [num_seqs={num_seqs}]; got {context_lens.shape}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got {arr.dtype}")


# ------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None,
                              sliding_window=None, soft_cap=None):
    """Reference decode paged attention (gather through the table, dense masked softmax).

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables i32[num_seqs, max_blocks_per_seq];
    context_lens i32[num_seqs] (0 allowed: that row's output is zero). The query of
    sequence i sits at position context_lens[i] - 1. sm_scale defaults to
    head_dim ** -0.5; sliding_window W keeps keys at positions > position - W;
    soft_cap c maps scores s to c * tanh(s / c).
    Returns [num_seqs, num_heads, head_dim] in q's dtype.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    # decode is the ragged case with exactly one query row per sequence
    query_start_loc = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


# ------------------------------------------------------------------------ public API


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "backend",
                                             "tuning"))
def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, sm_scale=None, sliding_window=None,
                    soft_cap=None, interpret=None, backend=None, tuning=None):
    """Decode paged attention: one query per sequence against its blocks in the paged cache.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] (num_heads a multiple of num_kv_heads, one dtype for all
    three); block_tables i32[num_seqs, max_blocks_per_seq] (entries past a sequence's
    used blocks are never read); context_lens i32[num_seqs], each at most
    max_blocks_per_seq * block_size, 0 allowed (that row's output is zero). The query
    of sequence i is at position context_lens[i] - 1. sm_scale defaults to
    head_dim ** -0.5; sliding_window W keeps keys at positions > position - W; soft_cap
    c maps scores s to c * tanh(s / c). Cache slots outside a sequence's context may hold
    anything, NaN included. Returns [num_seqs, num_heads, head_dim] in q's dtype.

    backend: None (jax.default_backend()), "cpu" (the kernel in interpret mode), "gpu",
    "cuda" or "rocm" (the kernel lowered to Triton), "tpu" (the Mosaic TPU kernel).
    interpret: None means interpret exactly when JAX's default backend is the CPU; True
    runs the chosen backend's kernel in interpret mode (TPU interpret mode for "tpu").
    tuning: a TritonTuning (blocks per loop step, splits of a sequence's blocks, warps,
    pipelining) for "gpu"; None means default_decode_tuning there (DEFAULT_DECODE_TUNING,
    with 2 stages where its 3 would not fit its chunk in shared memory) and one block per step
    in one split on "cpu" (given, "cpu" takes its chunks and splits too, so those paths
    are testable in interpret mode). Speed only.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if tuning is not None and not isinstance(tuning, TritonTuning):
        raise ValueError(f"tuning must be None or a TritonTuning; got {tuning!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or positive; got {soft_cap!r}")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be None or one of {_BACKENDS}; got {backend!r}")
    backend = backend or jax.default_backend()
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("Pallas kernels have no native CPU lowering: backend 'cpu' needs interpret=True (or None)")
    kwargs = dict(sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale),
                  sliding_window=sliding_window, soft_cap=soft_cap, interpret=bool(interpret))
    block_tables, context_lens = block_tables.astype(jnp.int32), context_lens.astype(jnp.int32)
    if backend == "tpu":
        if tuning is not None:
            raise ValueError("tuning applies to the Triton kernel (backend 'gpu' or 'cpu'), not to 'tpu'")
        return paged_attention_tpu_call(q, k_cache, v_cache, block_tables, context_lens, **kwargs)
    # CPU runs the same kernel unpadded; "gpu" in interpret mode keeps Triton's padding,
    # so the exact program Triton gets is testable on CPU
    on_cpu = backend == "cpu"
    if on_cpu and tuning is None:  # interpret mode reads one block as a view, a gathered chunk element-wise
        tuning = TritonTuning(chunk_tokens=1, kv_splits=1)
    return paged_attention_gpu_call(q, k_cache, v_cache, block_tables, context_lens, pad_for_triton=not on_cpu,
                                    tuning=tuning, **kwargs)
