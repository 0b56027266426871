"""The app's OpenAPI document (GET /openapi.json): request bodies, error responses, limits, the key.

Why by hand: every route reads its body itself (`parse_body` in app.py: JSON whatever
the Content-Type, finite numbers, strict types, this server's 400s), so FastAPI sees no
body parameter and would document none. Each route names its request models
(`body_doc`, as the route's `openapi_extra`) and the statuses it answers with
(`responses`); `install_openapi` puts the models in the document's components and fills
in what depends on this server (protocol.LIMIT markers: the served model's name, the
vocabulary's last token id, how many logprobs, whether `priority` is honoured), and the
bearer scheme when --api_key is set. A client generator, or a fuzzer
(experiments/benchmarks/schema_fuzz.py), then sees what the server accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from paged_jax.entrypoints.openai.protocol import LIMIT, SERVER_LIMITS, ErrorResponse

REF = "#/components/schemas/{model}"
ERRORS = {
    400: "invalid request: malformed JSON, wrong types, values out of range, a prompt the engine refuses",
    401: "missing or wrong API key (code invalid_api_key)",
    404: "unknown model (code model_not_found)",
    413: "body over --max_request_body_bytes (code request_too_large)",
    500: "the engine failed while the request was in flight (code engine_dead)",
    503: "waiting queue full (server_busy), shutting down (unavailable), engine failed (engine_dead)",
}
SSE = "text/event-stream"


def body_doc(*models: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its required JSON body is one of `models`."""
    refs = [{"$ref": REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def responses(*codes: int, ok: type[BaseModel] | None = None, stream: bool = False) -> dict[int | str, Any]:
    """A route's `responses`: the error statuses it answers with (OpenAI's error shape), and
    its 200 (`ok`; with `stream`, server-sent events of chunks as well)."""
    docs: dict[int | str, Any] = {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}
    if ok is not None:
        docs[200] = {"model": ok, "description": "the response"}
    if stream:
        docs[200]["description"] = "the response; with stream: true, server-sent events of chunks, then [DONE]"
        docs[200]["content"] = {SSE: {"schema": {"type": "string", "description": "data: <chunk JSON> events"}}}
    return docs


def apply_server_limits(node, limits: dict[str, Any]):
    """Replace every protocol.LIMIT marker in `node` (in place) by this server's bound:
    served_model -> enum of the one name, token_id -> maximum, logprobs -> maximum,
    priority -> only 0 unless the scheduler honours it. A limit given as None is dropped."""
    if isinstance(node, list):
        for item in node:
            apply_server_limits(item, limits)
    elif isinstance(node, dict):
        kind = node.pop(LIMIT, None)
        if kind is not None and kind not in SERVER_LIMITS:
            raise ValueError(f"unknown server limit {kind!r} in a request model (one of {SERVER_LIMITS})")
        value = limits.get(kind) if kind is not None else None
        if value is not None:
            if kind == "served_model":
                node["enum"] = [value]
            elif kind == "priority":
                if value != "priority":
                    node["enum"] = [0]
            else:
                node["maximum"] = value
        for item in node.values():
            apply_server_limits(item, limits)
    return node


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]], *, limits: dict[str, Any],
                    protected: tuple[str, ...] = (), api_key: str | None = None) -> None:
    """Make app.openapi() document `request_models` (and the models they use), with this
    server's `limits` (served_model, token_id, logprobs, priority: see apply_server_limits),
    and, when `api_key` is set, a bearer scheme required on paths starting with `protected`."""
    _, top = models_json_schema([(m, "validation") for m in request_models], ref_template=REF)
    defs = top.get("$defs", {})
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = build()
            components = document.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for name, schema in defs.items():
                schemas.setdefault(name, schema)
            apply_server_limits(document, limits)
            if api_key is not None:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                            "description": "Authorization: Bearer <--api_key>"}}
                for path, operations in document.get("paths", {}).items():
                    if path.startswith(protected):
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi
