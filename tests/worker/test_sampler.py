"""Sampling filters: seeded draws against distributions worked out independently here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.worker.sampler import row_keys, sample_tokens

NUM_DRAWS = 8000  # per-frequency standard error <= 0.0056; ATOL is ~4.5 sigma
ATOL = 0.025
_sample = jax.jit(sample_tokens)


def _draw(probs, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, first_seed=0):
    """Token frequencies of NUM_DRAWS rows that share logits log(probs) and parameters."""
    vocab = len(probs)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (NUM_DRAWS, vocab))
    full = lambda v, dt: jnp.full((NUM_DRAWS,), v, dt)
    keys = row_keys(jnp.arange(first_seed, first_seed + NUM_DRAWS, dtype=jnp.uint32), 0)
    toks = _sample(logits, full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                   full(min_p, jnp.float32), keys)
    return np.bincount(np.asarray(toks), minlength=vocab) / NUM_DRAWS


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def _vllm_expected(probs, temperature, top_k, top_p, min_p):
    """vLLM v1's sampler restated in float64 numpy, step by step as its source does it:
    logits / temperature; min-p as a logits processor (drop p < min_p * max p of the
    tempered distribution); then apply_top_k_top_p on an ascending sort: top-k masks
    logits below the k-th largest (ties with it stay), top-p takes the softmax of what is
    left, masks entries whose ascending cumulative sum is <= 1 - top_p, the last (largest)
    always kept. Returns the distribution the draws should follow."""
    logits = np.log(np.asarray(probs, np.float64)) / temperature
    p = _softmax(logits)
    logits = np.where(p < min_p * p.max(), -np.inf, logits)
    order = np.argsort(logits, kind="stable")
    ascending = logits[order]
    if top_k > 0:
        ascending = np.where(ascending < ascending[len(ascending) - min(top_k, len(ascending))], -np.inf, ascending)
    if top_p < 1.0:
        cut = np.cumsum(_softmax(ascending)) <= 1.0 - top_p
        cut[-1] = False
        ascending = np.where(cut, -np.inf, ascending)
    filtered = np.empty_like(ascending)
    filtered[order] = ascending
    return _softmax(filtered)


P5 = [0.05, 0.35, 0.12, 0.2, 0.28]  # vocabulary order is not probability order
CASES = [  # (probs, temperature, top_k, top_p, min_p)
    ([0.5, 0.3, 0.2], 1.0, 2, 0.6, 0.0),  # top-p on top-k's survivors [.625, .375]: just the first
    ([0.5, 0.3, 0.2], 1.0, 0, 0.6, 0.5),  # min-p first, then top-p on its survivors
    ([0.4, 0.3, 0.2, 0.1], 1.0, 3, 0.75, 0.0),
    (P5, 1.0, 3, 0.7, 0.0),
    (P5, 1.0, 0, 0.7, 0.4),
    (P5, 2.0, 3, 0.7, 0.2),
    (P5, 2.0, 4, 0.8, 0.4),
    (P5, 2.0, 0, 0.8, 0.4),
    (P5, 0.5, 0, 0.8, 0.2),
    (P5, 0.5, 2, 1.0, 0.0),
    (P5, 1.0, 10, 1.0, 0.0),  # top-k past the vocabulary: no cut
    (P5, 0.7, 0, 1.0, 0.0),
    ([0.3, 0.4, 0.3], 1.0, 2, 1.0, 0.0),  # a tie with the k-th token survives, as in vLLM
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_filters_compose_as_vllms(case):
    probs, temperature, top_k, top_p, min_p = CASES[case]
    want = _vllm_expected(probs, temperature, top_k, top_p, min_p)
    got = _draw(probs, temperature, top_k, top_p, min_p, first_seed=case * NUM_DRAWS)
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert np.all(got[want == 0] == 0), f"filtered-out tokens were drawn: {got} vs {want}"


def test_top_p_is_measured_after_top_k_and_min_p():
    # after top-k 2 (or min-p 0.5) the survivors are [.625, .375]: a 0.6 nucleus is the first
    # alone, where measuring on the full distribution (mass before .3 is .5 < .6) keeps both
    for kw in (dict(top_k=2), dict(min_p=0.5)):
        np.testing.assert_array_equal(_draw([0.5, 0.3, 0.2], top_p=0.6, **kw), [1.0, 0.0, 0.0])


def test_plain_sampling_follows_softmax():
    np.testing.assert_allclose(_draw([0.5, 0.3, 0.2]), [0.5, 0.3, 0.2], atol=ATOL)


def test_temperature():
    # p = [1/4, 3/4] at T=2 becomes proportional to [1, sqrt(3)] = [0.366, 0.634]
    np.testing.assert_allclose(_draw([0.25, 0.75], temperature=2.0), [0.366, 0.634], atol=ATOL)


def test_top_k_top_p_min_p_each_keep_the_two_best():
    # renormalised over the two best: 0.5 / 0.8 = 0.625 and 0.3 / 0.8 = 0.375
    expected = [0.625, 0.375, 0.0]
    np.testing.assert_allclose(_draw([0.5, 0.3, 0.2], top_k=2), expected, atol=ATOL)
    # top_p 0.7: mass before each token is 0, 0.5, 0.8 -> the third (0.8 >= 0.7) is cut
    np.testing.assert_allclose(_draw([0.5, 0.3, 0.2], top_p=0.7), expected, atol=ATOL)
    # min_p 0.5: keep p >= 0.5 * 0.5 = 0.25 -> 0.5 and 0.3 stay
    np.testing.assert_allclose(_draw([0.5, 0.3, 0.2], min_p=0.5), expected, atol=ATOL)


def test_filters_down_to_one_token_are_greedy():
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        np.testing.assert_array_equal(_draw([0.5, 0.3, 0.2], **kw), [1.0, 0.0, 0.0])


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
    logits = jax.random.normal(jax.random.key(0), (5, 50))
    keys = row_keys(jnp.arange(5, dtype=jnp.uint32), 2)
    temp = jnp.full(5, 0.9)
    off = (jnp.zeros(5, jnp.int32), jnp.ones(5), jnp.zeros(5))
    alone = sample_tokens(logits, temp, *off, keys)
    mixed = sample_tokens(logits, temp, jnp.array([0, 5, 0, 0, 0]), jnp.array([1.0, 1.0, 0.9, 1.0, 1.0]),
                          jnp.array([0.0, 0.0, 0.0, 0.0, 0.3]), keys)
    assert int(mixed[0]) == int(alone[0]) and int(mixed[3]) == int(alone[3])
    rows = jnp.array([1, 2, 4])
    only_filtered = sample_tokens(logits[rows], temp[rows], jnp.array([5, 0, 0]), jnp.array([1.0, 0.9, 1.0]),
                                  jnp.array([0.0, 0.0, 0.3]), keys[rows])
    assert [int(t) for t in only_filtered] == [int(mixed[i]) for i in (1, 2, 4)]


@pytest.mark.parametrize("top_k", [0, 2], ids=["plain", "filtered"])
def test_masked_tokens_stay_masked_at_the_largest_temperatures(top_k):
    """Tokens 0, 2 and 4 masked (-inf, a structured-output constraint); at temperature 3.4e38
    1 / T flushes to 0 on XLA CPU and -inf * 0 would be NaN (then token 0 was drawn: the fuzz
    finding in tests/entrypoints/test_fuzz_findings.py). Every draw must be an allowed token."""
    rows = 64
    logits = jnp.tile(jnp.array([-jnp.inf, 1.0, -jnp.inf, 2.0, -jnp.inf, 0.5]), (rows, 1))
    tokens = np.asarray(jax.jit(sample_tokens)(
        logits, jnp.full(rows, 3.4e38, jnp.float32), jnp.full(rows, top_k, jnp.int32), jnp.ones(rows),
        jnp.zeros(rows), row_keys(jnp.arange(rows, dtype=jnp.uint32), 0)))
    assert set(tokens.tolist()) <= {1, 3, 5}, tokens
