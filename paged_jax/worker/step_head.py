"""The step's head: from a batch's logits to each row's token, its logprob and the top-K.

Why it is its own jitted call and not the tail of the model step: XLA on CPU gives each
executable one preallocated temp buffer, sized for everything the function may hold at
once, whichever branch of a `cond` runs. The sampler's random path (threefry bits and a
full-vocabulary sort: a dozen [rows, vocab] arrays) made the model step's temp 84 MiB at
64 rows on SmolLM2, above glibc's 32 MiB ceiling for reusing freed memory, so every step
mapped fresh pages and faulted on them: ~3,300 page faults (12.6 MiB of zeroed pages) in
every 64-row decode step, even all-greedy ones (`experiments/trace_step_breakdown.py`
records faults per step). Now the model step returns the logits (a small temp, reused), a
batch of greedy rows runs `greedy_head` (argmax and logsumexp fuse into reductions: no
[rows, vocab] temporaries), and only a batch with a sampled row runs `sampled_head`. The
host picks the head from the batch's temperatures, which it already holds.

That is a CPU answer: on a GPU or TPU the second call is a second dispatch and a host round
trip per step, so there the platform fuses the head into the step (`Platform.fused_head`;
`fused_head` below). There the variants are not `lax.cond`s (a GPU runs a conditional by
copying its predicate to the host and waiting, which would hold the host until the step's
end): the host picks greedy or sampling, a program each, and the rest (the structured-output
mask, logprobs, the top-K) is computed for every row, a few reductions over the vocabulary.
head_dispatch.py runs the split heads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.worker.sampler import sample_tokens


class StepResult(NamedTuple):
    """Per scheduled chunk (row): what the step sampled and the next-token distribution's
    head (beam search candidates and the API's top logprobs; raw logits, no temperature),
    computed only in steps where some row asks for it (zeros otherwise: a top-K over the
    whole vocabulary for every row cost 12 ms of a 64-row SmolLM2 step here)."""

    tokens: np.ndarray  # i32[rows]: the sampled token
    logprobs: np.ndarray  # f32[rows]: its log-probability
    top_ids: np.ndarray  # i32[rows, K]: the K most likely next tokens, best first
    top_logprobs: np.ndarray  # f32[rows, K]: their log-probabilities
    prompt: "PromptLogprobRows | None" = None  # steps with prompt positions that asked for logprobs


def _result(logits, tokens, want_top, k: int, *, branch_free: bool = False) -> StepResult:
    """Logprob of each row's token (log_softmax without materializing it) when a row asked
    for logprobs (`want_top[0] >= 1`; else the token's raw logit, which nobody reads: the
    logsumexp over the vocabulary was 1.7 ms of a 32-row SmolLM2 step's 4.9 ms greedy head,
    a one-off measurement) and, when a row asked for alternatives (`want_top[0] == 2`), the
    top-K of the raw distribution. `branch_free`: both always (no `lax.cond`: `fused_head`)."""
    if branch_free:
        log_norm = jax.nn.logsumexp(logits, axis=-1)
        values, ids = jax.lax.top_k(logits, k)
        return StepResult(tokens, jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_norm,
                          ids, values - log_norm[:, None])
    log_norm = jax.lax.cond(want_top[0] > 0, lambda: jax.nn.logsumexp(logits, axis=-1),
                            lambda: jnp.zeros(logits.shape[0], jnp.float32))
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_norm

    def top():
        values, ids = jax.lax.top_k(logits, k)
        return values - log_norm[:, None], ids

    def no_top():
        return jnp.zeros((logits.shape[0], k), jnp.float32), jnp.zeros((logits.shape[0], k), jnp.int32)

    top_logprobs, top_ids = jax.lax.cond(want_top[0] > 1, top, no_top)
    return StepResult(tokens, logprobs, top_ids, top_logprobs)


def allowed(bitmask, vocab_size: int):
    """i32[rows, ceil(V / 32)] bitmask -> bool[rows, V]: token t is allowed where bit t % 32 of
    word t // 32 is set (llguidance's and xgrammar's layout)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def greedy_head_masked(logits, bitmask, want_top, *, k: int) -> StepResult:
    """greedy_head over the allowed tokens only (structured outputs); the logprobs stay
    those of the model's own distribution, as vLLM returns them."""
    logits = logits.astype(jnp.float32)
    tokens = first_max(jnp.where(allowed(bitmask, logits.shape[-1]), logits, -jnp.inf))
    return _result(logits, tokens, want_top, k)


def sampled_head_masked(logits, bitmask, temperature, top_k, top_p, min_p, seeds, sample_index, want_top, *,
                        k: int) -> StepResult:
    """sampled_head drawing from the allowed tokens only (the filters and the draw see the rest as -inf)."""
    logits = logits.astype(jnp.float32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)
    masked = jnp.where(allowed(bitmask, logits.shape[-1]), logits, -jnp.inf)
    tokens = sample_tokens(masked, temperature, top_k, top_p, min_p, keys)
    return _result(logits, tokens, want_top, k)


def first_max(logits):
    """jnp.argmax over the last axis (the first index of the maximum), as two plain
    reductions (max, then the least index holding it): XLA's CPU argmax, one variadic
    reduction, took 3.3 ms for 32 rows of a 49k vocabulary against 1.6 ms (one-off)."""
    best = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == best, index, logits.shape[-1]), axis=-1)


def greedy_head(logits, want_top, *, k: int) -> StepResult:
    """Every row greedy (temperature 0 or padding): the argmax."""
    logits = logits.astype(jnp.float32)
    return _result(logits, first_max(logits), want_top, k)


def sampled_head(logits, temperature, top_k, top_p, min_p, seeds, sample_index, want_top, *, k: int) -> StepResult:
    """Some row samples: `sample_tokens` with per-row parameters; row b draws with
    fold_in(key(seeds[b]), sample_index[b]), so its stream does not depend on its batch."""
    logits = logits.astype(jnp.float32)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)
    tokens = sample_tokens(logits, temperature, top_k, top_p, min_p, keys)
    return _result(logits, tokens, want_top, k)


def fused_head(logits, bitmask, use_mask, temperature, top_k, top_p, min_p, seeds, sample_index, *, k: int,
               sample: bool) -> StepResult:
    """The head inside the model step (a fused head: `Platform.fused_head`), without a
    `lax.cond` (the module docstring says why): `sample` (static, the host's pick: some row
    samples) draws with `sample_tokens` (branch-free), else every row takes its argmax; the
    structured-output mask applies to rows where `use_mask[0]` (a select, not a cond); logprobs
    and the top-K are always computed. The same tokens as the split heads: temperature-0 rows
    take the first index of the (masked) maximum, sampled rows draw with
    fold_in(key(seed), sample_index). `bitmask` None: no structured outputs (the runner's
    placeholder mask is one word wide and must not be read)."""
    logits = logits.astype(jnp.float32)
    masked = logits
    if bitmask is not None:
        masked = jnp.where(allowed(bitmask, logits.shape[-1]) | (use_mask[0] == 0), logits, -jnp.inf)
    if sample:
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)
        tokens = sample_tokens(masked, temperature, top_k, top_p, min_p, keys, branch_free=True)
    else:
        tokens = first_max(masked)
    return _result(logits, tokens, None, k, branch_free=True)


class PromptLogprobRows(NamedTuple):
    """Prompt logprobs of a step's prompt positions (rows of the flat token axis whose next
    token is a prompt token of a sequence that asked), in flat token order."""

    rows: np.ndarray  # i32[P]: the chunk (batch row) each position belongs to
    positions: np.ndarray  # i32[P]: the position p whose logits score prompt token p + 1
    logprobs: np.ndarray  # f32[P]: log p(prompt[p + 1] | prompt[:p + 1])
    ranks: np.ndarray  # i32[P]: 1 + how many tokens the model found more likely there
    top_ids: np.ndarray  # i32[P, K]: the K most likely tokens there, best first
    top_logprobs: np.ndarray  # f32[P, K]


def prompt_logprob_head(logits, targets, *, k: int):
    """f32[R, V] logits and i32[R] next prompt tokens -> (their logprob, rank, top-K
    logprobs, top-K ids). Ranks count strictly greater logits (vLLM's rank: ties share the
    better rank)."""
    logits = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[:, None], axis=-1)
    ranks = 1 + jnp.sum(logits > target_logits, axis=-1, dtype=jnp.int32)
    values, ids = jax.lax.top_k(logits, k)
    return target_logits[:, 0] - log_norm, ranks, values - log_norm[:, None], ids
