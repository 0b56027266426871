"""One thread owns the engine core; asyncio request handlers talk to it through queues.

Why a thread: a step blocks for the whole jitted call (tens to hundreds of
milliseconds), so it cannot run on the event loop, and the engine is not thread-safe,
so exactly one thread may touch it. That thread runs the engine core only (token ids in,
token ids out; engine/engine_core.py):

  1. waits on a condition while there is neither a command nor unfinished work (an idle
     server burns no CPU);
  2. applies queued commands between steps: adds (a group of engine requests per HTTP
     request, all or none), aborts (blocks freed at once) and finishes (a completion the
     front end found a stop string in);
  3. runs one core step while work exists, and hands each request's EngineCoreOutput to
     its HTTP request's RequestStream with `loop.call_soon_threadsafe` (the stream lives
     on the event loop). Handing over never blocks: a client that stops reading holds
     back only its own handler, and its stream keeps one merged output per request
     (request_stream.py), so the engine and every other request go on at full speed;
  4. publishes the core's stats after every iteration, for /metrics and for admission.

Everything with text runs elsewhere: prompts are tokenized on the app's tokenizer thread
and checked (engine/processor.py) in `submit`, and outputs are detokenized and checked
for stop strings on the event loop, per request (request_stream.py).

Admission is bounded: `submit` refuses (QueueFull, a 503) while the sequences waiting
in the scheduler plus those submitted but not yet handed to the engine reach
`max_waiting_requests`, so a flood of requests cannot grow memory without limit. A
request that was accepted is never dropped: it finishes, or its HTTP side aborts it
(client gone), or shutdown aborts it and its handler is told so. Shutdown is `drain()`
(refuse new requests), then `abort_all()` once the grace period is over
(uvicorn_server.py), then `stop()` (the app's lifespan), which joins the thread.

A failure is fatal, as in vLLM: an exception on the engine thread (a step, an abort,
the metrics hook; not a refused add) leaves the engine in an unknown state (blocks
half-assigned, a device buffer gone), so it is never stepped again. Instead, every
request it held or had queued gets EngineDead (non-streamed: a 500, streamed: an error
event and [DONE]), `submit` refuses every new one with EngineDead (a 503), `alive`
turns false (/health: 503), and `on_failure` is called so that the server exits
(GracefulServer sets it: the process ends with a non-zero status and a supervisor
restarts it). A server that kept its port open with a dead engine would look healthy
to a load balancer's TCP check while serving nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.engine.core_outputs import EngineCoreOutput
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.entrypoints.openai.request_stream import ACCEPTED, RequestAborted, RequestStream

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class EngineUnavailable(Exception):
    """Delivered to (or raised for) requests when the server stops or the engine failed."""


class EngineDead(EngineUnavailable):
    """The engine thread failed: this request (in flight or new) cannot be served, ever."""


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: Any  # whatever LLMEngine.add_request takes; the server sends {"prompt_token_ids": [...][, "cache_salt": s]}
    params: SamplingParams
    priority: int = 0  # lower runs earlier (scheduling_policy="priority"; must be 0 under "fcfs")
    kv_import: Any = None  # a PromptKV to adopt into the prefix cache first (a decode server's request)
    kv_export: bool = False  # once finished, export the prompt's K/V through the loop's connector (prefill server)


class EngineLoop:
    def __init__(self, engine, *, max_waiting_requests: int = 256,
                 on_step: Callable[[list[EngineCoreOutput]], None] | None = None,
                 on_iteration: Callable[[], None] | None = None, kv_connector=None):
        """`engine`: an LLMEngine; this loop drives its core and its processor (prompt
        checks), with its own OutputProcessor on the event loop. `on_step(outputs)` runs
        on the engine thread after each step that produced outputs; `on_iteration()` after
        every iteration (commands applied, a step run or not: the engine is between steps
        and may be read, as the dashboard's snapshots do). `kv_connector`: saves the
        prompt K/V of finished `kv_export` requests (kv_transfer_params.py)."""
        self.engine = engine
        self.core = engine.core
        self.output_processor = OutputProcessor(engine.tokenizer)  # event-loop thread only
        self.max_waiting_requests = max_waiting_requests
        self._on_step = on_step  # called on the engine thread after each step (metrics)
        self._on_iteration = on_iteration
        self._cond = threading.Condition()
        self._commands: list[tuple] = []  # guarded by _cond
        self._num_pending = 0  # sequences submitted, not yet counted in _num_waiting (guarded)
        self._num_waiting = 0  # the scheduler's waiting sequences at the last publish (guarded)
        self._stats: dict = self.core.stats()
        self._stopping = False
        self._draining = False  # shutting down: new requests are refused, running ones go on
        self._num_streams = 0  # requests with a listener at the last publish (guarded)
        self._sinks: dict[str, Callable[[Any], None]] = {}  # engine thread only
        self.kv_connector = kv_connector
        self._kv_exports: dict[str, tuple[list[int], str | None]] = {}  # engine thread only: prompt, salt
        self._kv_params: dict[str, dict] = {}  # request id -> saved K/V's params (guarded)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # set if the engine thread failed: the engine is unusable
        # Called once, on the engine thread, after a failure, once every request was told
        # (GracefulServer sets it to shut the server down).
        self.on_failure: Callable[[BaseException], None] | None = None

    # ---- lifecycle (event-loop thread) -------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="paged_jax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Abort everything outstanding (handlers get EngineUnavailable) and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def drain(self) -> None:
        """Refuse new requests from now on (503); those already accepted go on."""
        with self._cond:
            self._draining = True

    def abort_all(self, reason: str) -> None:
        """Abort every request now; each handler gets EngineUnavailable(reason)."""
        with self._cond:
            self._commands.append(("abort_all", reason))
            self._cond.notify()

    def has_requests(self) -> bool:
        """Whether any request is queued or running (as of the last iteration)."""
        with self._cond:
            return bool(self._num_pending or self._num_streams or self._commands)

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping and not self._draining
                and self.error is None)

    def stats(self) -> dict:
        """engine.stats() as of the end of the last iteration (safe from any thread)."""
        with self._cond:
            return dict(self._stats, num_pending=self._num_pending)

    # ---- requests (event-loop thread) --------------------------------------------------
    def submit(self, requests: list[EngineRequest], *, on_step: Callable[[], None] | None = None) -> RequestStream:
        """Queue a group of engine requests (one HTTP request). Raises QueueFull or
        EngineUnavailable; bad prompts surface from `RequestStream.accepted()`. `on_step()`
        runs on the event loop as each step's output of one of them arrives (metrics)."""
        loop = self._loop
        num_seqs = sum(r.params.n for r in requests)
        delta_ids = [r.request_id for r in requests if getattr(r.params, "output_kind", None) is RequestOutputKind.DELTA]
        stream = RequestStream(self, [r.request_id for r in requests], self.output_processor, delta_ids=delta_ids,
                               on_step=on_step)

        def deliver(item, _put=stream.put):
            try:
                loop.call_soon_threadsafe(_put, item)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        try:
            prompts = [self.engine.processor.process(r.prompt) for r in requests]
        except ValueError as exc:  # nothing is queued: the handler's accepted() raises it
            prompts = None
            stream.put(exc)
        with self._cond:
            if self.error is not None:
                raise EngineDead(_dead_message(self.error))
            if not self.alive:
                raise EngineUnavailable("the server is shutting down")
            if self._num_pending + self._num_waiting >= self.max_waiting_requests:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting_requests} sequences); retry later")
            if prompts is None:
                return stream
            for r, p in zip(requests, prompts):
                self.output_processor.add_request(r.request_id, p.text, p.token_ids, r.params)
            self._commands.append(("add", list(zip(requests, prompts)), deliver, num_seqs))
            self._num_pending += num_seqs
            self._cond.notify()
        return stream

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            self._commands.append(("abort", list(request_ids)))
            self._cond.notify()

    def wake(self) -> None:
        """Run one iteration even when idle (so `on_iteration` sees the engine now)."""
        with self._cond:
            self._commands.append(("wake",))
            self._cond.notify()

    def finish_sequence(self, request_id: str, index: int, stop: str) -> None:
        """End completion `index` of a request, stopped by stop string `stop` (front end)."""
        with self._cond:
            self._commands.append(("finish", request_id, index, stop))
            self._cond.notify()

    # ---- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # the engine is in an unknown state: tell everyone, then exit
            self._fail(exc)

    def _serve(self) -> None:
        core = self.core
        while True:
            with self._cond:
                while not (self._commands or self._stopping or core.has_unfinished_requests()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            added = 0
            for command in commands:
                added += self._apply(command)
            if stopping:
                added += self._abort_all(EngineUnavailable("the server is shutting down; the request was aborted"),
                                         refuse_queued=True)
                self._publish(added)
                return
            outputs = core.step() if core.has_unfinished_requests() else []
            for out in outputs:
                if out.finished and out.request_id in self._kv_exports:
                    self._export_kv(out.request_id)  # before its handler hears it finished
                sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
            if outputs and self._on_step is not None:
                self._on_step(outputs)
            self._publish(added)
            if self._on_iteration is not None:
                self._on_iteration()

    def _export_kv(self, request_id: str) -> None:
        """Save a finished prefill request's prompt K/V (its blocks are cached free now)."""
        token_ids, salt = self._kv_exports.pop(request_id)
        kv = self.core.export_prompt_kv(token_ids, cache_salt=salt)
        params = {"connector": None, "num_tokens": 0} if kv is None else self.kv_connector.save(request_id, kv)
        with self._cond:
            self._kv_params[request_id] = {**params, "do_remote_prefill": True}

    def take_kv_transfer_params(self, request_id: str) -> dict | None:
        """The params a finished export request's K/V were saved under (once)."""
        with self._cond:
            return self._kv_params.pop(request_id, None)

    def _fail(self, exc: Exception) -> None:
        """Mark the engine dead (new submits are refused from here on), give every request
        it held or had queued EngineDead, then call `on_failure`."""
        logger.exception("the engine failed; every request is aborted and the server exits")
        with self._cond:
            self.error = exc
        self._abort_all(EngineDead(_dead_message(exc)), refuse_queued=True)
        with self._cond:
            self._num_pending = 0  # every add was either applied (and is now aborted) or refused
        self._publish(0)
        if self.on_failure is not None:
            try:
                self.on_failure(exc)
            except Exception:
                logger.exception("on_failure failed")

    def _apply(self, command) -> int:
        """Apply one command; returns the sequences it took off the pending count."""
        if command[0] == "wake":
            return 0
        if command[0] == "abort_all":
            return self._abort_all(EngineUnavailable(command[1]))
        if command[0] == "abort":
            for request_id in command[1]:
                self.core.abort_request(request_id)
                self._kv_exports.pop(request_id, None)
                sink = self._sinks.pop(request_id, None)
                if sink is not None:
                    sink(RequestAborted(request_id))
            return 0
        if command[0] == "finish":  # its stream already ended the completion: nobody is told
            _, request_id, index, stop = command
            self.core.finish_sequence(request_id, index, stop)
            if not self.core.has_request(request_id):
                self._sinks.pop(request_id, None)
                self._kv_exports.pop(request_id, None)  # its handler answers without K/V (computed again)
            return 0
        _, requests, deliver, num_seqs = command
        done = []
        try:
            for r, prompt in requests:
                if r.kv_import is not None:  # right before its request: the blocks stay cached until admitted
                    self.core.import_prompt_kv(r.kv_import)
                self.core.add_request(r.request_id, prompt, r.params, cache_salt=prompt.cache_salt,
                                      priority=r.priority)
                done.append(r.request_id)
                if r.kv_export:
                    self._kv_exports[r.request_id] = (list(prompt.token_ids), prompt.cache_salt)
        except Exception as exc:  # ValueError: bad input (a 400); anything else: reported as is
            for request_id in done:  # all or nothing
                self.core.abort_request(request_id)
                self._kv_exports.pop(request_id, None)
            deliver(exc)
            return num_seqs
        for request_id in done:
            self._sinks[request_id] = deliver
        deliver(ACCEPTED)
        return num_seqs

    def _abort_all(self, reason: Exception, *, refuse_queued: bool = False) -> int:
        """Abort every request the engine holds (and, with refuse_queued, every add not yet
        applied); each listener gets `reason`. Returns the refused adds' sequences."""
        self._kv_exports.clear()
        for request_id, sink in list(self._sinks.items()):
            try:
                self.core.abort_request(request_id)
            except Exception:  # the engine may be broken (after a failed step): still tell the client
                logger.exception("abort of %s failed", request_id)
            sink(reason)
        self._sinks.clear()
        refused = 0
        if refuse_queued:
            with self._cond:
                leftover, self._commands = self._commands, []
            for command in leftover:
                if command[0] == "add":
                    command[2](reason)
                    refused += command[3]
        return refused

    def _publish(self, added: int) -> None:
        try:
            stats = self.core.stats()
        except Exception:
            logger.exception("the engine's stats() failed")
            stats = self._stats
        with self._cond:
            self._num_pending -= added
            self._num_waiting = int(stats.get("num_waiting", 0))
            self._num_streams = len(self._sinks)
            self._stats = stats


def _dead_message(exc: BaseException) -> str:
    return f"the engine failed ({type(exc).__name__}: {exc}); the server is shutting down"
