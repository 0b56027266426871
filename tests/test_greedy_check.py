"""The near-tie rule itself must be able to fail."""

import numpy as np
import pytest

from tests.helpers.greedy_check import assert_greedy_match


def test_near_tie_is_accepted_and_real_differences_are_not():
    logits = np.zeros(8, np.float32)
    logits[3], logits[5] = 2.0, 2.0 - 1e-4  # near-tie between 3 and 5; 7 far below
    assert_greedy_match([1], [3, 3, 3], [3, 3, 3], lambda ids: logits)
    assert_greedy_match([1], [3, 3, 3], [3, 5, 6], lambda ids: logits)  # diverges at a near-tie
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_match([1], [3, 3], [3, 7], lambda ids: logits)
    with pytest.raises(AssertionError, match="strict prefix"):
        assert_greedy_match([1], [3, 3], [3], lambda ids: logits)


def test_the_tie_is_measured_at_the_first_difference():
    seen = []

    def logits_after(ids):
        seen.append(list(ids))
        return np.zeros(4, np.float32)

    assert_greedy_match([9, 9], [1, 2, 3], [1, 0, 0], logits_after)
    assert seen == [[9, 9, 1]]  # prompt + the agreed prefix, nothing past the divergence
