"""Streaming text deltas that are never taken back.

The engine's RequestOutput carries each completion's full text so far. A stream sends
the part not yet sent, but two kinds of tail may still change and are held back while
the completion runs:

  * trailing U+FFFD: the last tokens end inside a multi-byte UTF-8 character, which the
    decoder shows as a replacement character until its remaining bytes arrive;
  * the longest tail that is a proper prefix of a stop string: if the stop string
    completes, the engine cuts the text where it starts, and that part must never have
    been streamed.

Why that is enough: byte-level BPE decoding is prefix-stable (the text of more tokens
starts with the text of fewer, up to an unfinished character), and while running, no
stop string occurs in the text (else it would have finished). So a stop string that
completes later either starts after what was sent or starts inside the held tail.
Once the completion finishes, its final text is authoritative and the rest is flushed.
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


class TextDeltaTracker:
    """Per completion: what has been sent, and what can be sent now."""

    def __init__(self, stops: tuple[str, ...] | None = None):
        self.stops = tuple(stops or ())
        self.sent = ""

    def delta(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
            end -= partial_stop_len(text[:end], self.stops)
        if end <= len(self.sent) or not text.startswith(self.sent):
            # nothing new, or (never expected) the text changed under what was sent: send
            # nothing rather than something inconsistent
            return ""
        out = text[len(self.sent):end]
        self.sent = text[:end]
        return out
