"""Ragged paged attention: a mixed batch of prefill chunks and decode tokens.

Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) of the flat
token axis: the last q_len_i of its context_lens[i] tokens (a prefill chunk, or one
decode token). Its keys and values live in the paged cache, block b of the sequence at
physical block block_tables[i, b]. Attention is causal within the sequence.

Where the pieces live. This file holds the contract: `ragged_paged_attention_reference`,
pure jnp (each token gathers its blocks through the block table a chunk at a time, f32
online softmax, so memory follows the batch's context, not max_model_len), the ground
truth and the engine's "reference" attention backend; and
`ragged_paged_attention`, the jitted public function, which checks shapes and picks a
backend. Each kernel variant has a file of its own, laid out kernel body, then its
pallas_call wrapper; ragged_tiling.py cuts the batch into query tiles for all of them:
  * ragged_paged_attention_gpu.py: `ragged_paged_attention_kernel`, the Pallas kernel
    for GPU (Triton) and CPU (interpret mode). A unit of work is a tile of a sequence's
    query tokens and a KV head (its whole GQA group); it walks the table
    `pages_per_chunk` pages at a time over only the pages the tile can see
    (sliding-window start to causal end), with an f32 online softmax; gathered K/V never
    exceed one chunk. Two tilings of the same body:
      - "gpu" (Triton): a program per (tile, KV head); group and head_dim padded to
        powers of two, TritonTuning.query_rows rows (at least 16) per program,
        masked stores of the tile's rows (decode steps go to the decode kernel when the
        engine runs on a GPU: paged_jax/attention/decode_dispatch.py).
      - "cpu" (interpret mode): one program that loops over every tile and does all KV
        heads at once: interpret mode pays per grid step (32 decode rows at context 512:
        the gpu tiling 19 ms, this program 5.7 ms, the jnp reference 6.3 ms).
    The online-softmax step the TPU variant shares lives there too.
  * ragged_paged_attention_tpu.py: Mosaic TPU: tiles and block tables scalar-prefetched
    into SMEM, the cache left in HBM (`pl.ANY`), each page's K/V copied into a
    double-buffered VMEM scratch by async DMA while the previous page computes, the
    tile's output written back token by token.

Every variant masks keys past context_len out of the scores *and* zeroes them in the
values, and never dereferences table entries past the context (unused slots may hold
NaN). Padding tokens get zeros; a sequence with q_len 0 owns no token and costs nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention_gpu import ragged_paged_attention_gpu_call
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu_call
from pallas_kernels.triton_tuning import DEFAULT_RAGGED_TUNING, TritonTuning

BACKENDS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_start_loc):
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [num_tokens, num_heads, head_dim] and k/v caches "
                         f"[num_blocks, block_size, num_kv_heads, head_dim] of one shape; got q {q.shape}, "
                         f"k_cache {k_cache.shape}, v_cache {v_cache.shape}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"head_dim {head_dim} vs cache {k_cache.shape[3]}, num_heads {num_heads} must be a "
                         f"multiple of num_kv_heads {num_kv_heads}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"block_tables {block_tables.shape} needs context_lens [{num_seqs}] and "
                         f"query_start_loc [{num_seqs + 1}]; got {context_lens.shape}, {query_start_loc.shape}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens),
                      ("query_start_loc", query_start_loc)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {arr.dtype}")


# keys per step of the reference's loop (rounded to whole blocks, at least one)
REFERENCE_CHUNK_TOKENS = 128


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                                     sm_scale=None, sliding_window=None, soft_cap=None):
    """Reference ragged paged attention.

    q [num_tokens, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables i32[num_seqs, max_blocks_per_seq];
    context_lens i32[num_seqs] (tokens in the cache after this step's writes);
    query_start_loc i32[num_seqs + 1] (non-decreasing; q_len_i <= context_lens[i]).
    Tokens past query_start_loc[num_seqs] are padding: their output is zero.
    sm_scale defaults to head_dim ** -0.5; sliding_window W keeps keys with
    position > query position - W; soft_cap c maps scores s to c * tanh(s / c).
    Returns [num_tokens, num_heads, head_dim] in q's dtype.

    Why a loop: gathering every token's whole table at once materializes
    [num_tokens, max_blocks_per_seq * block_size, ...] (~0.8 GB f32 per layer for a
    256-token chunk at max_model_len 2048). Instead each query token gathers its table
    REFERENCE_CHUNK_TOKENS keys (whole blocks) at a time, for ceil(max(context_lens) /
    chunk) steps, combined by an f32 online softmax (running max m, denominator l,
    accumulator acc): memory is bounded by one chunk, time by the batch's context, and
    neither by max_model_len.
    """
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    group = num_heads // num_kv_heads

    token = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], token, side="right")  # the sequence owning each token
    valid = token < query_start_loc[num_seqs]
    seq = jnp.minimum(seq, num_seqs - 1)
    # position of each query token inside its sequence: the q_len new tokens end the context
    position = context_lens[seq] - (query_start_loc[seq + 1] - token)
    context = context_lens[seq]

    chunk_blocks = min(max_blocks, max(1, REFERENCE_CHUNK_TOKENS // block_size))
    chunk = chunk_blocks * block_size
    num_chunks = -(-max_blocks // chunk_blocks)
    # whole chunks (the padding entries lie past every context: masked, never used)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * chunk_blocks - max_blocks)))
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)

    def step(c, carry):
        m, l, acc = carry
        ids = lax.dynamic_slice_in_dim(tables, c * chunk_blocks, chunk_blocks, axis=1)[seq]  # [T, chunk_blocks]
        keys = k_cache[ids].reshape(num_tokens, chunk, num_kv_heads, head_dim)
        values = v_cache[ids].reshape(num_tokens, chunk, num_kv_heads, head_dim)
        key_pos = c * chunk + jnp.arange(chunk)[None, :]
        # slots past the context (table padding, the last block's tail) may hold anything, NaN
        # included: mask them out of the scores and zero them in the values
        in_context = key_pos < context[:, None]
        values = jnp.where(in_context[:, :, None, None], values, 0)
        mask = (key_pos <= position[:, None]) & valid[:, None] & in_context
        if sliding_window is not None:
            mask &= key_pos > position[:, None] - sliding_window
        scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows that have seen no key yet
        probs = jnp.where(mask[:, None, None, :], jnp.exp(scores - m_safe[..., None]), 0.0)
        correction = jnp.exp(m - m_safe)  # 0 while m is -inf
        pv = jnp.einsum("tkgs,tskd->tkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return m_new, l * correction + jnp.sum(probs, axis=-1), acc * correction[..., None] + pv

    shape = (num_tokens, num_kv_heads, group)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    steps = jnp.minimum((jnp.max(context_lens, initial=0) + chunk - 1) // chunk, num_chunks)
    _, l, acc = lax.fori_loop(0, steps, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # fully masked rows (padding) give zeros
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "backend",
                                             "tuning"))
def ragged_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                           sm_scale=None, sliding_window=None, soft_cap=None, interpret=None, backend=None,
                           tuning=None):
    """Ragged paged attention, the Pallas kernel (same contract as the reference).

    q [num_tokens, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] of q's dtype (num_heads a multiple of num_kv_heads);
    block_tables i32[num_seqs, max_blocks_per_seq]; context_lens i32[num_seqs] (tokens in
    the cache after this step's writes, at most max_blocks_per_seq * block_size);
    query_start_loc i32[num_seqs + 1] (non-decreasing, query_start_loc[num_seqs] <=
    num_tokens, q_len_i = query_start_loc[i+1] - query_start_loc[i] <= context_lens[i]).
    Sequence i's tokens are the last q_len_i of its context and attend causally; rows
    with q_len 0 are allowed; tokens past query_start_loc[num_seqs] are padding and give
    zeros. Table entries past a sequence's context are never read, and cache slots
    outside it may hold anything, NaN included. sm_scale defaults to head_dim ** -0.5;
    sliding_window W keeps keys with position > query position - W; soft_cap c maps
    scores s to c * tanh(s / c). Returns [num_tokens, num_heads, head_dim] in q's dtype.

    backend: None (jax.default_backend()), "cpu" (the single-program tiling, interpret
    mode only), "gpu", "cuda" or "rocm" (the Triton tiling: a program per query tile and
    KV head; needs a power-of-two block_size), "tpu" (the Mosaic kernel). interpret: None
    means interpret exactly when JAX's default backend is the CPU; True runs the chosen
    backend's kernel in interpret mode (TPU interpret mode for "tpu"). tuning: a
    TritonTuning for the gpu tiling (query rows per program, keys per step, warps,
    pipelining); None means DEFAULT_RAGGED_TUNING. Speed only; other backends refuse one.
    """
    _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    if tuning is not None and not isinstance(tuning, TritonTuning):
        raise ValueError(f"tuning must be None or a TritonTuning; got {tuning!r}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q and the caches must be floating point; got {q.dtype}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be None or positive; got {soft_cap!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}; got {backend!r}")
    backend = {"cuda": "gpu", "rocm": "gpu"}.get(backend or jax.default_backend(), backend or jax.default_backend())
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if backend == "cpu" and not interpret:
        raise ValueError("Pallas kernels have no native CPU lowering: backend 'cpu' needs interpret=True (or None)")
    block_size = k_cache.shape[1]
    if backend == "gpu" and block_size & (block_size - 1):
        raise ValueError(f"the gpu tiling needs a power-of-two block_size; got {block_size}")
    kwargs = dict(sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale),
                  sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
                  interpret=bool(interpret))
    args = (q, k_cache, v_cache, block_tables.astype(jnp.int32), context_lens.astype(jnp.int32),
            query_start_loc.astype(jnp.int32))
    if tuning is not None and backend != "gpu":
        raise ValueError(f"tuning shapes the gpu tiling; backend {backend!r} takes none")
    if backend == "tpu":
        return ragged_paged_attention_tpu_call(*args, **kwargs)
    return ragged_paged_attention_gpu_call(*args, backend=backend, tuning=tuning or DEFAULT_RAGGED_TUNING, **kwargs)
