"""/dashboard: the engine's KV pool, live in a browser, served by the server itself.

    GET /dashboard             the page (HTML + JS shipped in the package: no build step, no CDN)
    GET /dashboard/snapshot    the latest snapshot, as JSON (engine/pool_snapshot.py)
    GET /dashboard/events      snapshots as server-sent events, as they are taken

Why here and not in a separate tool: the block pool is the paper's subject, and seeing
blocks fill, fork, get shared, cached, evicted and swapped under real traffic is what a
usage percentage cannot show. The page draws one cell per block, each request's blocks
on hover, and time series of the counters.

Cost, by construction: a snapshot is taken on the engine thread between steps (the only
thread that may read the engine), at most `max_rate` times a second while someone is
watching and never while nobody is; it is serialized once on the event loop and the same
string goes to every viewer, so ten open tabs cost what one does. Each viewer gets the
newest snapshot when it is ready for one (a slow viewer skips snapshots, it never queues
them). A snapshot that fails is logged and skipped: it must never take the engine down.

Read-only, and behind --api_key as /v1 is: the key as a bearer header or, since a
browser's EventSource cannot send headers, as `?key=` in the URL (the page passes the
key it was opened with on to its event stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from paged_jax.engine.pool_snapshot import take_snapshot
from paged_jax.entrypoints.openai.errors import APIError
from paged_jax.entrypoints.openai.http_guards import bearer_key_matches

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("dashboard_static")
PATHS = ("/dashboard", "/dashboard/snapshot", "/dashboard/events")
KEEPALIVE_SECONDS = 15.0  # an SSE comment while nothing changes, so proxies keep the stream open


class DashboardFeed:
    """Snapshots of one engine, taken on its thread and shared by every viewer."""

    def __init__(self, engine_loop, *, max_rate: float = 4.0, clock=time.monotonic):
        if not max_rate > 0:
            raise ValueError(f"max_rate must be > 0 snapshots per second, got {max_rate!r}")
        self.engine_loop = engine_loop
        self.interval = 1.0 / max_rate
        self._clock = clock
        self._last = -math.inf  # engine thread: when the last snapshot was taken
        self._want = False  # set by a new viewer (event loop), read on the engine thread
        self._num_tokens = 0  # engine thread: tokens the engine produced (tokens/s on the page)
        self.num_snapshots = 0
        self.snapshot_seconds = 0.0  # engine-thread time spent taking snapshots
        self.num_viewers = 0  # event loop
        self.latest: str | None = None  # event loop: the newest snapshot's JSON
        self.version = 0
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """On the event loop, before the engine thread starts (the app's lifespan)."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()

    # ---- the engine thread ---------------------------------------------------------------
    def on_step(self, outputs) -> None:
        self._num_tokens += sum(len(d.new_token_ids) for out in outputs for d in out.completions)

    def on_iteration(self) -> None:
        """After each engine-loop iteration (commands applied, maybe a step run): a snapshot
        when a viewer asked for one, or while someone watches, at most every `interval`,
        except that the iteration that leaves the engine idle is always shown (nothing
        changes after it until the next command, which is another iteration)."""
        try:
            want, self._want = self._want, False
            if not (want or self.num_viewers):
                return
            now = self._clock()
            idle = not self.engine_loop.core.has_unfinished_requests()
            if not (want or idle or now - self._last >= self.interval):
                return
            start = time.perf_counter()
            snapshot = take_snapshot(self.engine_loop.core, num_generated_tokens=self._num_tokens, clock=self._clock)
            self.snapshot_seconds += time.perf_counter() - start
            self.num_snapshots += 1
            self._last = now
            self._loop.call_soon_threadsafe(self._publish, snapshot)
        except Exception:  # a picture is not worth the engine: log it, keep serving
            logger.exception("the dashboard's snapshot failed")

    # ---- the event loop ------------------------------------------------------------------
    def _publish(self, snapshot: dict) -> None:
        self.latest = json.dumps(snapshot, separators=(",", ":"))
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # every viewer waiting wakes once

    def request_snapshot(self) -> None:
        self._want = True
        self.engine_loop.wake()

    async def next_snapshot(self, seen: int, timeout: float) -> int:
        """Wait until a snapshot newer than version `seen` exists (or `timeout` passes);
        returns the current version."""
        if self.version == seen:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.version

    async def events(self):
        """One viewer's server-sent events: the newest snapshot whenever there is a newer
        one, a keep-alive comment while nothing changes; ends when the server shuts down."""
        self.num_viewers += 1
        try:
            seen, quiet_since = 0, time.monotonic()
            self.request_snapshot()  # the current state, even if the engine is idle
            while self.engine_loop.alive:
                version = await self.next_snapshot(seen, 1.0)  # wakes each second to see a shutdown
                if version != seen:
                    seen, quiet_since = version, time.monotonic()
                    yield f"data: {self.latest}\n\n"
                elif time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
        finally:
            self.num_viewers -= 1


def _page() -> str:
    html = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    script = (STATIC_DIR / "dashboard.js").read_text(encoding="utf-8")
    return html.replace("/*DASHBOARD_JS*/", script)


def register_dashboard_routes(app: FastAPI, feed: DashboardFeed, *, api_key: str | None,
                              served_model_name: str) -> None:
    page = _page().replace("__MODEL__", served_model_name)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        authorization = request.headers.get("authorization", "")
        if not authorization:  # a browser's EventSource sends no header: the key is in the URL
            authorization = "Bearer " + request.query_params.get("key", "")
        if not bearer_key_matches(authorization, api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or open "
                                "/dashboard?key=<key>", code="invalid_api_key")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request):
        check_key(request)
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/snapshot", include_in_schema=False)
    async def dashboard_snapshot(request: Request):
        """A fresh snapshot (taken at the engine's next iteration), as JSON."""
        check_key(request)
        seen = feed.version
        feed.request_snapshot()
        while feed.version == seen:
            await feed.next_snapshot(seen, 30.0)
            if not feed.engine_loop.alive:
                raise APIError(503, "the engine is not running", code="unavailable")
        return JSONResponse(json.loads(feed.latest))

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request):
        check_key(request)
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
