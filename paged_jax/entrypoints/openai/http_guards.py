"""ASGI middleware in front of the routes: the API key, then the request body size.

Plain ASGI rather than FastAPI dependencies, for order: an unauthenticated request is
refused (401) before its body is read or parsed, and an oversized body (413) before it
is buffered whole. The body read here is replayed to the app once; later `receive`
calls go to the server, so the handlers still see the client's disconnect.
"""

from __future__ import annotations

import secrets

from paged_jax.entrypoints.openai.errors import APIError


def bearer_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an Authorization header value is `Bearer <api_key>` (compared in constant
    time). The one check behind /v1 (here), the tokenizer routes and /dashboard."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


class HTTPGuards:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, protected_prefix: str = "/v1"):
        self.app, self.api_key, self.max_body_bytes, self.prefix = app, api_key, max_body_bytes, protected_prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith(self.prefix) and not self._authorized(headers):
            return await self._reply(scope, receive, send, APIError(
                401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key"))
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await self._reply(scope, receive, send, APIError(400, "invalid Content-Length header"))
            if int(declared) > self.max_body_bytes:
                return await self._reply(scope, receive, send, self._too_large(int(declared)))
        parts, total, pending = [], 0, []
        while True:  # also bounds chunked bodies, which declare no length
            message = await receive()
            if message["type"] != "http.request":
                pending.append(message)
                break
            total += len(message.get("body", b""))
            if total > self.max_body_bytes:
                return await self._reply(scope, receive, send, self._too_large(total))
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = pending or [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay_receive():
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replay_receive, send)

    def _authorized(self, headers: dict) -> bool:
        return bearer_key_matches(headers.get("authorization", ""), self.api_key)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes "
                             "(--max_request_body_bytes)", code="request_too_large")

    @staticmethod
    async def _reply(scope, receive, send, error: APIError) -> None:
        await error.response()(scope, receive, send)
