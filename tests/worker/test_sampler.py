"""Sampling filters: hand-checkable distributions over three tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.worker.sampler import row_keys, sample_tokens

NUM_DRAWS = 4000  # per-frequency standard error <= 0.008; tolerances below are ~4 sigma


def _draw(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    vocab = len(logits)
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (NUM_DRAWS, vocab))
    full = lambda v, dt: jnp.full((NUM_DRAWS,), v, dt)
    keys = row_keys(jnp.arange(NUM_DRAWS, dtype=jnp.uint32), 0)
    toks = sample_tokens(logits, full(temperature, jnp.float32), full(top_k, jnp.int32),
                         full(top_p, jnp.float32), full(min_p, jnp.float32), keys)
    return np.bincount(np.asarray(toks), minlength=vocab) / NUM_DRAWS


PROBS = np.log([0.5, 0.3, 0.2])


def test_plain_sampling_follows_softmax():
    np.testing.assert_allclose(_draw(PROBS), [0.5, 0.3, 0.2], atol=0.03)


def test_temperature():
    # p = [1/4, 3/4] at T=2 becomes proportional to [1, sqrt(3)] = [0.366, 0.634]
    np.testing.assert_allclose(_draw(np.log([0.25, 0.75]), temperature=2.0), [0.366, 0.634], atol=0.03)


def test_top_k_top_p_min_p_each_keep_the_two_best():
    # renormalised over the two best: 0.5 / 0.8 = 0.625 and 0.3 / 0.8 = 0.375
    expected = [0.625, 0.375, 0.0]
    np.testing.assert_allclose(_draw(PROBS, top_k=2), expected, atol=0.03)
    # top_p 0.7: mass before each token is 0, 0.5, 0.8 -> the third (0.8 >= 0.7) is cut
    np.testing.assert_allclose(_draw(PROBS, top_p=0.7), expected, atol=0.03)
    # min_p 0.5: keep p >= 0.5 * 0.5 = 0.25 -> 0.5 and 0.3 stay
    np.testing.assert_allclose(_draw(PROBS, min_p=0.5), expected, atol=0.03)


def test_filters_down_to_one_token_are_greedy():
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        np.testing.assert_array_equal(_draw(PROBS, **kw), [1.0, 0.0, 0.0])


def test_greedy_rows_mixed_with_sampled_rows():
    logits = jnp.array([[0.0, 1.0, 0.5], [0.0, 1.0, 0.5], [2.0, 0.0, 0.0]])
    keys = row_keys(jnp.array([0, 1, 2], jnp.uint32), 5)
    toks = sample_tokens(logits, jnp.array([0.0, 50.0, 0.0]), jnp.zeros(3, jnp.int32),
                         jnp.ones(3), jnp.zeros(3), keys)
    assert int(toks[0]) == 1 and int(toks[2]) == 0  # greedy rows: argmax


def test_row_streams_depend_only_on_seed_and_step():
    a = row_keys(jnp.array([7, 8], jnp.uint32), 3)
    b = row_keys(jnp.array([9, 7], jnp.uint32), 3)
    assert jnp.array_equal(jax.random.key_data(a[0]), jax.random.key_data(b[1]))
    c = row_keys(jnp.array([7], jnp.uint32), 4)
    assert not jnp.array_equal(jax.random.key_data(a[0]), jax.random.key_data(c[0]))


def test_a_rows_draw_does_not_depend_on_its_neighbours_filters():
    """Unfiltered rows skip the vocabulary sort unless a filtered row is present; either
    way an unfiltered row must draw the same token (and a filtered one likewise)."""
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    keys = row_keys(jnp.arange(4, dtype=jnp.uint32), 2)
    temp = jnp.full(4, 0.9)
    off = (jnp.zeros(4, jnp.int32), jnp.ones(4), jnp.zeros(4))
    alone = sample_tokens(logits, temp, *off, keys)
    mixed = sample_tokens(logits, temp, jnp.array([0, 5, 0, 0]), jnp.array([1.0, 1.0, 0.9, 1.0]),
                          jnp.zeros(4), keys)
    assert int(mixed[0]) == int(alone[0]) and int(mixed[3]) == int(alone[3])
    only_filtered = sample_tokens(logits[1:3], temp[:2], jnp.array([5, 0]), jnp.array([1.0, 0.9]),
                                  jnp.zeros(2), keys[1:3])
    assert [int(t) for t in only_filtered] == [int(mixed[1]), int(mixed[2])]
