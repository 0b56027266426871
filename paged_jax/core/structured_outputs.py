"""StructuredOutputsParams: the one constraint a completion's tokens must satisfy (vLLM's names).

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
object), `regex`, `choice` (one of these strings, exactly) or `grammar` (an EBNF grammar:
llama.cpp's GBNF or Lark) is set. The engine compiles it for the model's tokenizer with
llguidance and, before each token is sampled, lets through only the tokens that keep the
text a prefix of something the constraint accepts (`paged_jax/engine/grammar_matchers.py`).
Pure Python, validated on construction; whether the schema or grammar itself is valid is
the library's to say when the request is added (a ValueError with its message).
"""

from __future__ import annotations

import dataclasses
import json as _json
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between tokens of the JSON but single spaces after ':' and ','
    # (vLLM's flag; by default the JSON may hold any whitespace the schema allows)
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_kinds) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple[str, str, bool]:
        """(kind, text, flexible whitespace): the constraint as values, the key grammars are
        compiled and cached by."""
        kind, flexible = self.kind, not self.disable_any_whitespace
        if kind == "json":
            # the schema's own key order: it is the order of the object's properties in the output
            return kind, self.json if isinstance(self.json, str) else _json.dumps(self.json), flexible
        if kind == "json_object":
            return kind, '{"type": "object"}', flexible
        if kind == "choice":
            return kind, _json.dumps(list(self.choice)), flexible
        return kind, getattr(self, kind), flexible
