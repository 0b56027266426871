"""Request bodies as JSON that the rest of the server can trust: finite numbers, valid
Unicode, bounded nesting. Each failure is a 400 that says what was wrong.

Python's `json` accepts more than JSON: the literals `NaN`, `Infinity` and `-Infinity`,
numbers such as `1e309` that overflow to infinity, and (for bytes) lone UTF-16
surrogates such as `"\\ud800"` or the raw bytes `ed a0 80`, which it decodes with
`surrogatepass`. None of these is a value a client can mean: a non-finite temperature
would compare false with every range check, and a surrogate cannot be encoded by the
tokenizer. A body nested deeper than the interpreter's recursion limit raises
RecursionError inside the parser; that is refused too, not answered with a 500.

A number written with a fraction or exponent but whole (`2.0`, `1e2`) is parsed as the
integer it is. JSON has one number type, and JSON Schema's "integer" (what the OpenAPI
schema says of `n`, `max_tokens`, token ids) matches `2.0`; the request models are
strict (a string is never coerced to a number), so without this a client that writes
`"n": 2.0` would get a 400 the schema says it should not (schema fuzzing sends such
values: experiments/benchmarks/schema_fuzz.py). A float field takes the integer as the
same float.
"""

from __future__ import annotations

import json
import math

from paged_jax.entrypoints.openai.errors import bad_request


def _constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _float(text: str) -> float | int:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range (overflows to infinity)")
    return int(value) if value.is_integer() else value


def parse_json_body(raw: bytes):
    """The parsed body; raises APIError(400) for invalid JSON, non-finite numbers, deep
    nesting and text that is not valid Unicode."""
    try:
        data = json.loads(raw, parse_constant=_constant, parse_float=_float)
    except RecursionError as exc:
        raise bad_request("the request body is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request("the request body contains a lone UTF-16 surrogate "
                          f"({exc.object[exc.start:exc.end]!r}), which is not valid Unicode text") from exc
    except RecursionError as exc:
        raise bad_request("the request body is nested too deeply") from exc
    return data
