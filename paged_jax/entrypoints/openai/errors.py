"""Every error the server returns, in OpenAI's shape: {"error": {message, type, param, code}}.

OpenAI clients parse this body to build their exceptions, so FastAPI's own shapes
(`{"detail": ...}`, status 422) are replaced: bad input of any kind is a 400 with a
message that says what was wrong. Status codes used:

    400 invalid_request_error  malformed JSON, wrong types, bad sampling values, prompt too long
    401 invalid_request_error  missing or wrong API key (code "invalid_api_key")
    404 invalid_request_error  unknown model (code "model_not_found", as OpenAI) or route
    413 invalid_request_error  body over --max_request_body_bytes (code "request_too_large")
    500 server_error           the engine failed while the request was in flight (code
                               "engine_dead"; a stream gets the same body as its last event);
                               a completion ended with finish reason "error", an internal
                               failure such as a grammar matcher's (code "generation_error",
                               as vLLM's 500; a stream: the same body as its last event)
    503 server_error           waiting queue full (code "server_busy"), shutting down (code
                               "unavailable"), the engine failed before the request came
                               (code "engine_dead": the server is exiting)

Any other 500 would mean a bug: the catch-all handler still answers in this shape and logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_jax.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """Raised anywhere in request handling; becomes an OpenAI error response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def server_busy(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="server_busy")


def unavailable(exc: Exception) -> APIError:
    return APIError(503, str(exc), type="server_error", code="unavailable")


def engine_dead(exc: Exception, *, in_flight: bool) -> APIError:
    """The engine failed: a 500 for a request it held (it failed), a 503 for one that came
    after (the server is going away; a client may retry elsewhere)."""
    return APIError(500 if in_flight else 503, str(exc), type="server_error", code="engine_dead")


def generation_error(output) -> APIError | None:
    """The 500 for a RequestOutput one of whose completions ended with finish reason
    "error" (the engine logged why), else None: a failed completion must not reach the
    client as a finished one."""
    failed = [c.index for c in output.outputs if c.finish_reason == "error"]
    if not failed:
        return None
    return APIError(500, f"completion {failed[0]} of the request failed inside the engine (its structured-output "
                         "grammar matcher reported an error; the server log has the details)",
                    type="server_error", code="generation_error")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable one-liner from pydantic's error list, and the offending top-level field."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if loc and param is None:
            param = loc[0]
        where = ".".join(loc)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, param


def install_error_handlers(app: FastAPI, on_api_error: Callable[[APIError], None] | None = None) -> None:
    """`on_api_error` sees every APIError raised by a route (metrics count refusals)."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if on_api_error is not None:
            on_api_error(exc)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug; still answer in the API's shape
        logger.exception("unhandled error in %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()
