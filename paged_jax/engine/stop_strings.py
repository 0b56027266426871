"""Stop strings on a completion's growing text: find them early, never show one.

Each step appends the completion's new text and looks for a stop string only where one
could now end: in the new text or straddling its start (before this step none occurred,
else the completion would have ended). Of the matches, the earliest in the text wins,
whatever its place in the stop list, and the text is cut where it starts (the stop string
is not included, vLLM's default).

While the completion runs, the tail of the text that could still grow into a stop string
(the longest suffix that is a proper prefix of one) is held back: it is not part of the
text shown yet. The shown prefix only ever grows: if a tail of length k is a proper
prefix of a stop string after d more characters, its first k - d were held back before;
and a stop string that completes later starts at or after the shown end, so cutting there
takes nothing back. Once the completion ends the hold-back is released.
"""

from __future__ import annotations


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def earliest_stop(text: str, new_from: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the earliest stop string that ends at or after `new_from`;
    of two starting at the same place, the shorter (it completed first)."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start != -1 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
            best = (start, stop)
    return best


class StopStringChecker:
    """One completion's text: all of it so far, the prefix that may be shown, and the
    stop string that ended it, if one did.

    The text is kept in pieces and joined only when the whole of it is read (`text`,
    `shown`: once, for a final output), so a step's work is the new text plus the few
    characters before it that a stop string could start in, not the whole text (which a
    step of a long output would otherwise copy). Outputs take the shown text piecewise
    (`take`): each call returns the part shown since the previous one, read from the last
    pieces only, so a stream's step costs what that step added, at token 10 as at 10,000."""

    def __init__(self, stops: tuple[str, ...] | None):
        self.stops = tuple(stops or ())
        self._lookback = max((len(s) for s in self.stops), default=1) - 1  # a stop may start this far back
        self._pieces: list[str] = []
        self._length = 0
        self._shown = 0  # text[:_shown] may be shown
        self._taken = 0  # text[:_taken] was returned by take() (never more than _shown)
        self.stop: str | None = None

    @property
    def text(self) -> str:
        """The whole text (joined here: O(length), for a final output, not for every step)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def shown(self) -> str:
        """The text that can be shown now: a prefix of every later `shown`, and of the final text."""
        return self.text[: self._shown]

    def take(self) -> str:
        """The shown text that no earlier `take` returned: concatenated, the takes are `shown`.
        It costs the characters since the previous take (plus a held-back tail), not the whole text."""
        new = self._tail(self._taken)[: self._shown - self._taken]
        self._taken = self._shown
        return new

    def append(self, new_text: str, final: bool) -> str | None:
        """Add the completion's next text (`final`: nothing more will come); returns the
        stop string that ended it now, if one did (the text is then cut where it starts)."""
        if self.stop is not None:
            raise RuntimeError(f"the completion already ended at stop string {self.stop!r}")
        old_len = self._length
        if new_text:
            self._pieces.append(new_text)
            self._length += len(new_text)
        tail_start = max(0, old_len - self._lookback)
        tail = self._tail(tail_start) if self.stops else ""
        if self.stops and new_text:
            hit = earliest_stop(tail, old_len - tail_start, self.stops)
            if hit is not None:  # the cut starts at or after what was shown (see the module docstring)
                start, self.stop = tail_start + hit[0], hit[1]
                self._cut(start)
                self._shown = start
                return self.stop
        self._shown = self._length if final else self._length - partial_stop_len(tail, self.stops)
        return None

    def _cut(self, length: int) -> None:
        """Drop the text from `length` on, from the last pieces only."""
        while self._pieces and self._length - len(self._pieces[-1]) >= length:
            self._length -= len(self._pieces.pop())
        if self._length > length:  # the last piece straddles the cut
            last = self._pieces[-1]
            self._pieces[-1] = last[: len(last) - (self._length - length)]
            self._length = length

    def _tail(self, start: int) -> str:
        """text[start:], from the last pieces only."""
        need, parts = self._length - start, []
        for piece in reversed(self._pieces):
            if need <= 0:
                break
            parts.append(piece[-need:] if len(piece) > need else piece)
            need -= len(piece)
        return "".join(reversed(parts))
