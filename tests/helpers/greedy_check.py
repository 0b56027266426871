"""The one accepted difference between two greedy runs: a near-tie in the reference.

Float rounding can flip the argmax where the reference's two best logits are within
~1e-3; after that the runs legitimately diverge. Everything before the first
difference must match, and the tie itself is checked, never assumed.
"""

import numpy as np

TIE_TOLERANCE = 1e-3


def assert_greedy_match(prompt, expected, actual, reference_logits, tol=TIE_TOLERANCE):
    """expected: the reference's generated tokens; actual: the candidate's.

    reference_logits(token_ids) -> f32[vocab], the reference's logits for the token that
    follows `token_ids`. Passes when the two are equal, or when they first differ at a
    position where the reference's logits of both tokens are within `tol` (and the
    shorter one is not simply cut short).
    """
    expected, actual = list(expected), list(actual)
    if expected == actual:
        return
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            logits = np.asarray(reference_logits(list(prompt) + expected[:i]))
            gap = abs(float(logits[e]) - float(logits[a]))
            assert gap <= tol, (f"outputs differ at generated token {i}: reference {e}, got {a}; "
                                f"reference logits differ by {gap:.3g} > {tol} (not a near-tie)\n"
                                f"reference {expected}\ngot       {actual}")
            return
    raise AssertionError(f"one output is a strict prefix of the other:\nreference {expected}\ngot       {actual}")
