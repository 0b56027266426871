"""Token sampling from logits with per-row parameters.

Every knob is a per-row array, never a static argument, so one compiled step serves any
mix of greedy and sampled requests. Row b draws with its own key, so its random stream
does not depend on what else is in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits, temperature, top_k, top_p, min_p, keys, *, branch_free: bool = False):
    """Pick one token per row.

    logits f32[B, V]; temperature f32[B] (0 = greedy); top_k i32[B] (<= 0 = off);
    top_p f32[B] (>= 1 = off); min_p f32[B] (0 = off); keys: typed PRNG keys [B].
    Returns i32[B].

    The filters compose as vLLM's v1 sampler does (temperature, then the min-p logits
    processor, then top-k and top-p), so a request means the same thing on both:
      1. temperature divides the logits;
      2. min-p keeps tokens whose tempered probability is at least min_p times the most
         likely token's;
      3. top-k keeps the k most likely of those, and every token tied with the k-th;
      4. top-p keeps the smallest prefix (most likely first) of what is left whose mass,
         renormalized over what is left, reaches top_p: a token stays while the mass
         before it is below top_p.
    The most likely token always survives; the draw follows the survivors' renormalized
    probabilities. E.g. p = [.5, .3, .2] with top_k 2 and top_p .6 always gives token 0:
    after top-k the mass is [.625, .375], and .625 already reaches .6.

    Rows without top-k / top-p / min-p draw straight from the tempered logits; only rows
    with a filter pay for sorting the vocabulary (~80x slower on CPU for a 49k vocabulary),
    and the sort, a single one serving all three filters, runs only when such a row is
    present. Which path a row takes depends on its own parameters alone, so its stream
    never depends on its batch.

    `branch_free`: no `lax.cond` (the accelerators' fused step, whose host picked a sampling
    variant already: a GPU waits on the host for a conditional's predicate): every path is
    computed and each row takes its own, so the vocabulary is sorted whenever any row samples.
    The same tokens either way.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temp = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0)

    def tempered():
        # a masked token (-inf: structured outputs) stays -inf: XLA on CPU divides by multiplying
        # with 1 / temp, which flushes to 0 near float32's largest temperatures, and -inf * 0 is NaN
        return jnp.where(jnp.isneginf(logits), -jnp.inf, logits / temp)

    def plain():
        return jax.vmap(jax.random.categorical)(keys, tempered()).astype(jnp.int32)

    def with_filters():
        vocab = logits.shape[-1]
        sorted_logits, sorted_ids = jax.lax.top_k(tempered(), vocab)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # min-p, relative to the most likely token (column 0 of the descending sort)
        keep = probs >= min_p[:, None] * probs[:, :1]
        # top-k by value: the k-th logit is the bar, so ties with it stay
        kth = jnp.take_along_axis(sorted_logits, jnp.clip(top_k, 1, vocab)[:, None] - 1, axis=-1)
        keep &= (top_k[:, None] <= 0) | (sorted_logits >= kth)
        # both cuts above drop a tail of the sort, so the survivors are a prefix and the
        # mass before a survivor counts survivors only; comparing it with top_p times the
        # survivors' total is top-p on the renormalized distribution
        kept = jnp.where(keep, probs, 0.0)
        mass_before = jnp.cumsum(kept, axis=-1) - kept
        nucleus = top_p[:, None] * jnp.sum(kept, axis=-1, keepdims=True)
        keep &= (top_p[:, None] >= 1.0) | (mass_before < nucleus)
        keep = keep.at[:, 0].set(True)  # the most likely token always survives
        choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
        picked = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(filtered, picked, plain())

    if branch_free:
        return jnp.where(temperature > 0, with_filters(), greedy)

    def sample():
        return jax.lax.cond(jnp.any((temperature > 0) & filtered), with_filters, plain)

    sampled = jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)
    return jnp.where(temperature > 0, sampled, greedy)


def row_keys(seeds, step):
    """Typed keys [B]: row b at decode step `step` draws from fold_in(key(seeds[b]), step)."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), step))(seeds)
