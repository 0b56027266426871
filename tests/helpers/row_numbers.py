"""The numbers a results-table row shows, for tests that check that a row carries its
record's figures (and the arithmetic on them) without pinning the row's wording: the words
may be edited freely, the numbers are the data the row exists to show."""

from __future__ import annotations

import re

# a number not glued to a word or another number ("12-80" is 12 and 80; "-0.01" keeps its sign)
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(text: str) -> list[str]:
    """The numbers of text, in order, as written ("1.20x" -> "1.20", "+11.3%" -> "+11.3")."""
    return _NUMBER.findall(text)


def shows_in_order(text: str, *expected: str) -> bool:
    """Whether text shows the expected numbers in this order (others may come between)."""
    found = iter(numbers(text))
    return all(any(n == want for n in found) for want in expected)
