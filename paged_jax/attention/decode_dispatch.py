"""Decode steps to a decode-only attention, other steps to the ragged one, inside the step.

Most engine steps only decode: every sequence has at most one query token, the last of
its context. A kernel written for that case (one program per sequence and KV head, or
the XLA loop of chunked_attention.py) beats a ragged kernel that tiles query tokens:
on an H200 the Pallas decode kernel took 0.12 ms where the ragged one took 0.25 ms for 64
SmolLM2 rows at context 2048 (`bash experiments/gpu_check.sh`, record
bench_kernel_h200_tunings). Decode and mixed steps share padded shapes, so which one
runs is decided on device (`lax.cond` on the step's query lengths), not by compiling
both kinds of step. Where the caller knows the kind (`kind`: the runner does, from the
batch it built, and compiles a program per kind), no `cond` is traced at all: on a GPU,
XLA runs a conditional by copying its predicate to the host and waiting for it, so a cond
in each layer made the host wait on the device 30 times a step (and async scheduling,
which needs the host free while the step runs, pointless).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


STEP_KINDS = ("decode", "mixed")


def decode_or_ragged(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *, decode, ragged,
                     sm_scale=None, sliding_window=None, soft_cap=None, kind=None):
    """q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
    i32[S, max_blocks]; context_lens i32[S]; query_start_loc i32[S + 1]. Returns
    [T, Hq, D] in q's dtype (padding tokens: zeros).

    decode(rows_q [S, Hq, D], k_cache, v_cache, block_tables, kv_lens i32[S], sm_scale=,
    sliding_window=, soft_cap=) -> [S, Hq, D]: row r's query sits at position
    kv_lens[r] - 1 and attends to its first kv_lens[r] keys (0: output zeros). It runs
    when every sequence has at most one query token; ragged (the ragged contract's
    arguments and options) otherwise. `kind` (static): "decode" (the caller guarantees at
    most one query token per sequence), "mixed", or None (decided on device)."""
    if kind not in (None, *STEP_KINDS):
        raise ValueError(f"kind must be one of {STEP_KINDS} or None, got {kind!r}")
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc = (
        jnp.asarray(a) for a in (q, k_cache, v_cache, block_tables, context_lens, query_start_loc))
    num_tokens = q.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

    def per_sequence():
        has_query = q_lens > 0
        rows_q = q[jnp.minimum(query_start_loc[:-1], num_tokens - 1)]
        kv_lens = jnp.where(has_query, context_lens, 0)
        out = decode(rows_q, k_cache, v_cache, block_tables, kv_lens, **options)
        # a sequence without a query token writes nowhere (index past the end: dropped)
        index = jnp.where(has_query, query_start_loc[:-1], num_tokens)
        return jnp.zeros_like(q).at[index].set(out.astype(q.dtype), mode="drop")

    def mixed():
        return ragged(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, **options)

    if kind == "decode":
        return per_sequence()
    if kind == "mixed":
        return mixed()
    return lax.cond(jnp.all(q_lens <= 1), per_sequence, mixed)
