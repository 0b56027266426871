"""Token sampling from logits with per-row parameters.

Every knob is a per-row array, never a static argument, so one compiled step serves any
mix of greedy and sampled requests. Row b draws with its own key, so its random stream
does not depend on what else is in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits, temperature, top_k, top_p, min_p, keys):
    """Pick one token per row.

    logits f32[B, V]; temperature f32[B] (0 = greedy); top_k i32[B] (<= 0 = off);
    top_p f32[B] (>= 1 = off); min_p f32[B] (0 = off; keep tokens whose probability is
    at least min_p times the most likely one's); keys: typed PRNG keys [B].
    Filters apply in vLLM's order: temperature, then top-k, top-p and min-p on the
    tempered distribution. Returns i32[B].

    Rows without top-k / top-p / min-p draw straight from the tempered logits; only rows
    with a filter pay for sorting the vocabulary (~80x slower on CPU for a 49k vocabulary),
    and the sort runs only when such a row is present. Which path a row takes depends
    on its own parameters alone, so its stream never depends on its batch.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temp = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0)

    def plain():
        return jax.vmap(jax.random.categorical)(keys, logits / temp).astype(jnp.int32)

    def with_filters():
        vocab = logits.shape[-1]
        sorted_logits, sorted_ids = jax.lax.top_k(logits / temp, vocab)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        ranks = jnp.arange(vocab)[None, :]
        keep = (top_k[:, None] <= 0) | (ranks < top_k[:, None])
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep &= (top_p[:, None] >= 1.0) | (mass_before < top_p[:, None])
        keep &= probs >= min_p[:, None] * probs[:, :1]
        keep = keep.at[:, 0].set(True)  # the most likely token always survives
        choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
        picked = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(filtered, picked, plain())

    def sample():
        return jax.lax.cond(jnp.any((temperature > 0) & filtered), with_filters, plain)

    sampled = jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)
    return jnp.where(temperature > 0, sampled, greedy)


def row_keys(seeds, step):
    """Typed keys [B]: row b at decode step `step` draws from fold_in(key(seeds[b]), step)."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), step))(seeds)
