"""What a response must be, for schema_fuzz.py: the server's contract, checked per response.

Why a module of its own: these are the rules a fuzzed response is judged by, apart from
how cases are generated and sent, and tests/entrypoints/test_fuzz_schema.py reads them
through the driver only.

    - status < 500, and not 1xx/3xx;
    - a 4xx body is OpenAI's error shape: exactly {"error": {"message": non-empty str,
      "type": str, "param": str | null, "code": str | null}};
    - the media type is one the operation documents for that status (a status it does not
      document at all falls back to "default", then to any JSON);
    - where JSON is documented, the body parses (no NaN or Infinity either) and, for a
      2xx, matches the documented schema (JSON Schema 2020-12, OpenAPI 3.1's dialect,
      with the document's components to resolve $ref);
    - an SSE stream (text/event-stream) has only `data:` events that are JSON objects
      or `[DONE]`, no error event, and ends with `[DONE]`; and no raw character that
      str.splitlines takes for a line break but SSE does not (U+2028, NEL, ...), which
      would cut an event for clients that read lines that way (httpx's iter_lines).
"""

from __future__ import annotations

import json
import re

import jsonschema

ERROR_KEYS = {"message", "type", "param", "code"}
JSON = "application/json"
SSE = "text/event-stream"
SPLITLINES_ONLY = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # line breaks to str.splitlines, not to SSE


def promised_content(documented: dict, status: int | None) -> dict:
    """{media type: schema} the operation documents for `status` (exact code, then "4XX"
    style, then "default"); a status it does not document: JSON, any schema."""
    responses = documented.get("responses", {})
    if status is None:
        return {}
    for key in (str(status), f"{status // 100}XX", "default"):
        if key in responses:
            content = responses[key].get("content") or {}
            return {media: (spec or {}).get("schema") for media, spec in content.items()}
    return {JSON: None}


def error_shape_problem(body) -> str | None:
    """None if `body` is OpenAI's error shape, else what is wrong with it."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return f"the body is not {{'error': ...}}: top-level keys {sorted(body) if isinstance(body, dict) else body!r}"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return f"error has keys {sorted(error) if isinstance(error, dict) else error!r}, not {sorted(ERROR_KEYS)}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(error["type"], str):
        return "error.type is not a string"
    for key in ("param", "code"):
        if error[key] is not None and not isinstance(error[key], str):
            return f"error.{key} is neither a string nor null"
    return None


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def schema_problem(value, schema: dict | None, document: dict) -> str | None:
    """None if `value` matches `schema` (refs resolved in `document`), else the first error."""
    if not schema:
        return None
    root = {**schema, "components": document.get("components", {})}
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(root).iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where or '(root)'}: {error.message[:200]}"


def sse_problem(text: str) -> str | None:
    """None if `text` is a well-formed stream of JSON events ending with [DONE], read
    line by line as SSE says (\\r, \\n); also readable by clients that split lines as
    str.splitlines does (httpx's and requests' iter_lines), which no raw U+2028 etc. breaks."""
    raw = sorted({f"U+{ord(c):04X}" for c in text if c in SPLITLINES_ONLY})
    if raw:
        return f"a raw {', '.join(raw)} in an event: a client reading lines with str.splitlines cuts it there"
    lines = re.split(r"\r\n|\r|\n", text)
    events = [line[len("data:"):].strip() for line in lines if line.startswith("data:")]
    other = [line for line in lines if line and not line.startswith(("data:", ":"))]
    if other:
        return f"a line that is not a data event: {other[0][:100]!r}"
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with [DONE] (last event {events[-1][:100] if events else None!r})"
    for event in events[:-1]:
        try:
            data = _strict_json(event)
        except ValueError as exc:
            return f"an event that is not JSON ({exc}): {event[:100]!r}"
        if not isinstance(data, dict):
            return f"an event that is not a JSON object: {event[:100]!r}"
        if "error" in data:
            return f"an error event: {event[:300]}"
    return None


def judge(status: int, media: str, raw: bytes, promised: dict, document: dict) -> list[tuple[str, str]]:
    """[(failure kind, detail)] for one whole response; [] when it keeps the contract."""
    text = raw.decode("utf-8", "replace")
    if status >= 500:
        return [("server_error", _message(text))]
    if status < 200 or 300 <= status < 400:
        return [("unexpected_status", f"status {status}")]
    problems = []
    if promised and media not in promised:
        problems.append(("content_type", f"{media or 'no Content-Type'} is not among {sorted(promised)}"))
    if media == SSE:
        problem = sse_problem(text)
        return problems + ([("stream", problem)] if problem else [])
    if status >= 400 or JSON in promised or media == JSON:
        try:
            body = _strict_json(text)
        except ValueError as exc:
            return problems + [("not_json", f"{exc}"[:200])]
        if status >= 400:
            problem = error_shape_problem(body)
            return problems + ([("error_shape", problem)] if problem else [])
        problem = schema_problem(body, promised.get(JSON), document)
        if problem:
            problems.append(("response_schema", problem))
    return problems


def _message(text: str) -> str:
    """The error message of an error body (what tells one bug from another), else the text."""
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]
