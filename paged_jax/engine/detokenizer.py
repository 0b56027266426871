"""Incremental detokenization: each step decodes a completion's new tokens only.

Decoding a completion's whole output every step (to show its text or look for stop
strings) costs O(length) per step and O(length^2) per completion. Instead each
completion keeps a stream: with a `tokenizers` backend, its `DecodeStream`, which
decodes a window of the last few tokens and returns the text they add once it is
complete (None while the last tokens end inside a multi-byte character); without one, the
same window algorithm over `tokenizer.decode`. Both keep the same window (`_prefix_start`
.. `_read`: the tokens of the last text returned, then those not yet returned), so a
stream whose DecodeStream raises continues on the fallback where it stood. The window
stays short also when tokens never complete a character (invalid UTF-8, which a
random-weight model emits): after _MAX_PENDING such tokens the text of all but the last
_SEALING tokens is taken as it stands, U+FFFD included, and the stream continues on the
window algorithm (a DecodeStream cannot be moved past text it did not return).

Text is returned only where it is final: a longer decode extends it (vLLM's
prefix_offset/read_offset rule). A window whose decode does not extend the text already
returned from it (a character completed across the cut, a decoder that rewrites earlier
text) returns nothing and waits; text is never dropped for it, so the concatenation of a
stream's pieces is the whole decode of its tokens.

Some tokenizers' `decode` also "cleans up tokenization spaces" (" ." -> ".", " 's" ->
"'s", ...; transformers' `clean_up_tokenization`), which rewrites text already produced
when the next token arrives. That step is applied here to committed text only: a tail
that could still become the start of one of its patterns is held back (as stop strings
are, stop_strings.py), so the text a stream has returned is final. Whether a tokenizer
cleans up is asked of the tokenizer itself (its `decode` against the raw decoder), since
transformers applies the flag differently across versions and tokenizer kinds.
"""

from __future__ import annotations

from paged_jax.engine.stop_strings import partial_stop_len

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the window algorithm over tokenizer.decode only
    DecodeStream = None

# transformers' clean_up_tokenization, in its order
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_CLEANUP_PATTERNS = tuple(old for old, _ in _CLEANUP)
_CLEANUP_PROBE = "a . b , c ! d ? e 's f n't"
# Tokens without a complete character after which the window's text is taken as it
# stands: a character is at most 4 bytes, so such a run holds invalid bytes (a random
# model's byte tokens), and waiting would only grow the window. (Should its last bytes
# start a character that later tokens complete, that character shows as U+FFFD.)
_MAX_PENDING = 16
# Tokens kept back when text is taken as it stands: a character is at most 4 bytes and
# a token at least 1, so a character begun before the last 3 tokens has met its fate (it
# is complete, or broken and shown as U+FFFD) by the end of the window. Text up to
# there that the whole window's decode extends is final.
_SEALING = 3


def clean_up_spaces(text: str) -> str:
    for old, new in _CLEANUP:
        text = text.replace(old, new)
    return text


class Detokenizer:
    """A tokenizer's decoding, settled once: its fast backend if it has one, and whether
    its `decode` cleans up spaces. `stream()` starts one completion's text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = backend if DecodeStream is not None and hasattr(backend, "decode") else None
        self.cleans_up = self._decode_cleans_up()

    def decode_raw(self, token_ids: list[int]) -> str:
        """The text of `token_ids` before any space clean-up (special tokens skipped)."""
        if self.backend is not None:
            return self.backend.decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_cleans_up(self) -> bool:
        if not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return False
        ids = list(self.tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False))
        raw = self.decode_raw(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True) == clean_up_spaces(raw) != raw

    def stream(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def decode(self, token_ids: list[int]) -> str:
        """A whole output at once, as a stream would give it."""
        stream = self.stream()
        return stream.push(token_ids) + stream.flush()


class _SpaceCleanup:
    """Clean-up of a growing text, applied to what no later text can change."""

    def __init__(self):
        self._held = ""

    def push(self, raw: str) -> str:
        text = self._held + raw
        cut = len(text)
        while k := partial_stop_len(text[:cut], _CLEANUP_PATTERNS):
            cut -= k  # "x '" may become "x's" or "x'y": keep " '" (and whatever that leaves exposed)
        self._held = text[cut:]
        return clean_up_spaces(text[:cut])

    def flush(self) -> str:
        text, self._held = self._held, ""
        return clean_up_spaces(text)


class IncrementalDetokenizer:
    """One completion's token ids in, the text they add out."""

    def __init__(self, detokenizer: Detokenizer):
        self._detok = detokenizer
        self._stream = DecodeStream(skip_special_tokens=True) if detokenizer.backend is not None else None
        self._cleanup = _SpaceCleanup() if detokenizer.cleans_up else None
        self._ids: list[int] = []
        self._prefix_start = 0  # first token of the last text returned (context for the next)
        self._read = 0  # tokens before this have had their text returned
        self._prefix_text = ""  # fallback: the text of tokens [_prefix_start, _read)

    def push(self, token_ids: list[int]) -> str:
        """The new text that `token_ids` (the completion's next tokens) complete."""
        out = []
        for token in token_ids:
            self._ids.append(int(token))
            text = self._step(int(token))
            if text is None and len(self._ids) - self._read >= _MAX_PENDING:
                # not a character cut short: invalid bytes, shown as U+FFFD as a whole decode shows them
                if self._stream is not None:  # a DecodeStream cannot be moved on from outside: the window continues
                    self._stream = None
                    self._prefix_text = self._decode(self._ids[self._prefix_start:self._read])
                out.append(self._commit_sealed())
            elif text is not None:
                self._commit(len(self._ids))
                out.append(text)
        raw = "".join(out)
        return self._cleanup.push(raw) if self._cleanup is not None else raw

    def flush(self) -> str:
        """The completion ended: the text of tokens not yet returned (a character cut short
        shows as U+FFFD, as a whole decode would show it) and any held clean-up tail."""
        tail = ""
        if self._read < len(self._ids):
            tail = self._pending_text()
            self._prefix_start = self._read = len(self._ids)
        if self._cleanup is not None:
            return self._cleanup.push(tail) + self._cleanup.flush()
        return tail

    def _commit(self, read: int) -> None:
        """Tokens before `read` have had their text returned; the window's context moves on."""
        self._prefix_start, self._read = self._read, read
        if self._stream is None:
            self._prefix_text = self._decode(self._ids[self._prefix_start:read])

    def _commit_sealed(self) -> str:
        """A long run without a complete character: return the text of the pending tokens
        but the last _SEALING, where it is final (the whole window's decode extends it and
        it extends the text already returned); else nothing yet."""
        window = self._ids[self._prefix_start:]
        full = self._decode(window)
        for cut in range(len(self._ids) - _SEALING, max(self._read, len(self._ids) - _MAX_PENDING), -1):
            text = self._decode(window[:cut - self._prefix_start])
            if text.startswith(self._prefix_text) and full.startswith(text):
                new = text[len(self._prefix_text):]
                self._commit(cut)
                return new
        return ""

    def _pending_text(self) -> str:
        """The text tokens [_read, end) add after the window's earlier tokens, as it stands.
        Should the window's decode not extend the text already returned from it (a decoder
        that rewrites earlier text), it is the part after what the two have in common: no
        text of the whole decode is lost."""
        prefix = self._prefix_text if self._stream is None else self._decode(self._ids[self._prefix_start:self._read])
        full = self._decode(self._ids[self._prefix_start:])
        if full.startswith(prefix):
            return full[len(prefix):]
        common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        return full[common:]

    def _step(self, token: int) -> str | None:
        if self._stream is not None:
            try:
                return self._stream.step(self._detok.backend, token)
            except Exception:  # e.g. a decoder whose output is not prefix-stable: the window continues
                self._stream = None
                self._prefix_text = self._decode(self._ids[self._prefix_start:self._read])
        text = self._decode(self._ids[self._prefix_start:])
        if len(text) > len(self._prefix_text) and not text.endswith("\ufffd") and text.startswith(self._prefix_text):
            return text[len(self._prefix_text):]
        return None

    def _decode(self, token_ids: list[int]) -> str:
        return self._detok.decode_raw(token_ids)
