"""Streaming text deltas that are never taken back.

Each RequestOutput's completion text is what the engine may show so far (its output
processor holds back a tail that could still become a stop string, and text of a
character whose bytes have not all arrived), and successive texts extend one another.
So a stream sends, each step, the part of the text it has not sent yet; nothing it sent
is ever cut by a stop string that completes later.
"""

from __future__ import annotations


class TextDeltaTracker:
    """Per completion: what has been sent, and what can be sent now."""

    def __init__(self):
        self.sent = ""

    def delta(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            # nothing new, or (never expected) the text changed under what was sent: send
            # nothing rather than something inconsistent
            return ""
        out = text[len(self.sent):]
        self.sent = text
        return out
