"""Running the app under uvicorn: in the foreground (serve_local) or a background thread.

Shutdown (SIGINT/SIGTERM in the foreground, `stop()` in a thread) is graceful in this
order: stop listening; the engine loop drains (new requests get 503, /health turns 503);
requests still running get `grace` seconds to finish; then the engine aborts the rest,
so every handler answers (a stream ends with an error event and `data: [DONE]`, a
waiting client gets a 503) and its blocks are freed; then uvicorn closes the
connections and the app's lifespan stops the engine thread. uvicorn's own
`timeout_graceful_shutdown` (task cancellation) stays as a backstop.

An engine failure shuts the server down the same way, by itself: the engine loop has
already answered every request it held (engine_loop.py) and calls `engine_failed`,
which records the error and sets uvicorn's `should_exit` (a flag its main loop polls
every 0.1 s, so setting it from the engine thread is safe). `serve()` then raises
EngineDead, so that the entry point exits non-zero and a supervisor (systemd,
Kubernetes, a shell loop) restarts the process; a BackgroundServer's thread just ends,
with the error in `engine_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time

import uvicorn

from paged_jax.entrypoints.openai.engine_loop import EngineDead

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down; the request was aborted"


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, grace: float = 5.0, ready_message: str | None = None):
        super().__init__(config)
        self.grace = grace
        self.ready_message = ready_message
        self.engine_error: BaseException | None = None  # set by engine_failed
        loop = _engine_loop(config.app)
        if loop is not None:
            loop.on_failure = self.engine_failed

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.ready_message:  # uvicorn's own lines come before: this one is last
            print(self.ready_message, file=sys.stderr, flush=True)

    def engine_failed(self, exc: BaseException) -> None:
        """The engine loop's on_failure (called on the engine thread): shut down."""
        logger.error("the engine failed (%s: %s); shutting the server down", type(exc).__name__, exc)
        self.engine_error = exc
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = _engine_loop(self.config.app)
        if loop is not None:
            for server in self.servers:  # no new connections while draining
                server.close()
            loop.drain()
            await self._wait(loop, self.grace)
            if loop.has_requests():
                loop.abort_all(SHUTDOWN_MESSAGE)
                await self._wait(loop, 10.0)  # the handlers send their last event
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn re-raises a captured SIGINT after its shutdown, inside asyncio.run, which
        turns a clean stop into KeyboardInterrupt tracebacks; the signal has done its job
        (a graceful stop), so it is dropped here."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    @staticmethod
    async def _wait(loop, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while loop.has_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _engine_loop(app):
    return getattr(getattr(app, "state", None), "engine_loop", None)


def _config(app, *, log_level: str, grace: float, **kwargs) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace + 15, **kwargs)


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", grace: float = 5.0,
          ready_message: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM (blocking; call from the main thread). Raises EngineDead
    (the engine's exception as its cause) when the server stopped because the engine failed.
    `ready_message` is printed to stderr once the port is bound (start-up's last line)."""
    server = GracefulServer(_config(app, log_level=log_level, grace=grace, host=host, port=port), grace=grace,
                            ready_message=ready_message)
    server.run()
    if server.engine_error is not None:
        error = server.engine_error
        raise EngineDead(f"the engine failed ({type(error).__name__}: {error})") from error


class BackgroundServer:
    """The app on a socket bound here (port 0: a free one) in a daemon thread, for
    notebooks, tests and in-process benchmarks. Outside the main thread uvicorn installs
    no signal handlers; `stop()` does what SIGINT does."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace: float = 5.0, start_timeout: float = 120):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = GracefulServer(_config(app, log_level=log_level, grace=grace), grace=grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="paged_jax-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def loop(self):
        """The app's EngineLoop (stats, admission bound)."""
        return self.app.state.engine_loop

    @property
    def engine_error(self) -> BaseException | None:
        """The engine's exception if it failed (the server then stops by itself)."""
        return self.server.engine_error

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
