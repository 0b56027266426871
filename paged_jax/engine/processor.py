"""Prompts in, validated token ids out: the front end's half of accepting a request.

A prompt is text, a list of token ids, {"prompt_token_ids": [...]} or {"prompt": text};
either dict may add "cache_salt" (requests with different salts never share prefix-cache
blocks). Everything is checked here, before the engine core queues anything, so a bad
prompt is a ValueError for its caller and never a failure inside a step. The token-id
checks are plain functions because the core repeats them for callers that hand it ids
directly, and the core checks a request's max_tokens against its prompt here too
(`validate_max_tokens`), since the prompt's length is known only once it is tokenized.
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Sequence as Seq

import numpy as np


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None  # the prompt text, when it was given as text
    token_ids: list[int]
    cache_salt: str | None = None
    # (max_model_len, vocab_size) that token_ids were checked against: an engine core given
    # this prompt with its own limits skips converting and checking it again
    checked: tuple[int, int] | None = dataclasses.field(default=None, compare=False)


def refuse_bools(token_ids) -> None:
    """ValueError if a token id is a bool. `True` is an int in Python (and array "q" and
    int() take it as 1), so without this check `[True, 5]` would be the prompt [1, 5]: a
    bool where a token id belongs is a caller's mistake. C passes only (`map(type)`, a
    dtype check): every request's prompt passes here."""
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None:
        is_bool = dtype.kind == "b"
    else:
        types = set(map(type, token_ids))
        is_bool = bool in types or np.bool_ in types
    if is_bool:
        index = next(i for i, t in enumerate(token_ids) if isinstance(t, (bool, np.bool_)))
        raise ValueError(f"token ids must be ints, got the bool {token_ids[index]!r} at index {index} "
                         "(True and False are not token ids)")


def int_list(token_ids) -> list[int]:
    """`token_ids` as a new list of Python ints, `int()` of each (bools refused). A list or
    tuple of ints converts in one C pass (array "q"): every request's prompt passes here."""
    if not isinstance(token_ids, (list, tuple, np.ndarray)):  # a generator is read once: keep what it gives
        token_ids = list(token_ids)
    refuse_bools(token_ids)
    if isinstance(token_ids, (list, tuple)):
        try:
            return array("q", token_ids).tolist()
        except (TypeError, OverflowError):  # floats, ints past int64, ...: int() of each below
            pass
    return list(map(int, token_ids))


def validate_prompt_token_ids(token_ids: Seq[int], max_model_len: int, vocab_size: int) -> None:
    """A prompt must leave room for one generated token and name only vocabulary ids."""
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {max_model_len}, so a prompt "
                         f"may have at most {max_model_len - 1} tokens (room for one generated token)")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # C loops: a prompt is checked at every request
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def validate_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt and the tokens asked for must fit the context: ValueError (the server's
    400, with vLLM's wording) when prompt + max_tokens exceeds max_model_len, rather than
    cutting the completion short unasked. A request that did not say its max_tokens gets
    the context its prompt leaves (the server's default) and passes."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                         f"in the completion: max_tokens={max_tokens}). Please reduce the length of the prompt or "
                         f"max_tokens (at most {max_model_len - num_prompt_tokens} with this prompt).")


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        """`tokenizer`: anything with `encode(text) -> ids` (None: token-id prompts only)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def process(self, prompt) -> ProcessedPrompt:
        """The prompt's text, token ids and cache salt; raises ValueError on bad input."""
        cache_salt = None
        if isinstance(prompt, dict):
            prompt, cache_salt = self._unpack(prompt)
        text, token_ids = self._tokenize(prompt)
        validate_prompt_token_ids(token_ids, self.max_model_len, self.vocab_size)
        return ProcessedPrompt(text, token_ids, cache_salt, (self.max_model_len, self.vocab_size))

    @staticmethod
    def _unpack(prompt: dict):
        keys = set(prompt)
        if not ({"prompt_token_ids"} <= keys <= {"prompt_token_ids", "cache_salt"}
                or {"prompt"} <= keys <= {"prompt", "cache_salt"}):
            raise ValueError("a dict prompt must be {'prompt_token_ids': [...]} or {'prompt': str}, optionally "
                             f"with 'cache_salt': str; got keys {sorted(prompt, key=str)}")
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty str, got {salt!r}")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"{{'prompt': ...}} must hold a str, got {type(prompt['prompt']).__name__}")
            return prompt["prompt"], salt
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str):  # text here would otherwise be tokenized as if it were {'prompt': ...}
            raise ValueError("prompt_token_ids must be a list of token ids, got a str (use {'prompt': text})")
        return ids, salt

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would raise TypeError
                raise ValueError(f"the prompt is not valid Unicode text: {exc.reason} at index {exc.start}") from exc
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple, np.ndarray)):
            refuse_bools(prompt)
        if isinstance(prompt, (list, tuple)) and prompt:
            try:  # one C pass for the common case, plain ints (non-ints and ints past int64 raise)
                return None, array("q", prompt).tolist()
            except (TypeError, OverflowError):
                pass  # refused or converted below
        if isinstance(prompt, (list, tuple, np.ndarray)):
            try:
                ids = np.asarray(prompt) if len(prompt) else None
            except (ValueError, TypeError):  # ragged nesting: refused below with this module's message
                ids = None
            if ids is not None and ids.ndim == 1 and ids.dtype.kind in "iu":  # one C pass: the common case
                return None, ids.tolist()
            if all(isinstance(t, (int, np.integer)) for t in prompt):  # empty, bools, ints past int64
                return None, [int(t) for t in prompt]
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict; got {type(prompt).__name__}")
