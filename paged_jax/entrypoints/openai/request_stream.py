"""The asyncio side of one HTTP request: the engine core's outputs become RequestOutputs.

The engine thread (engine_loop.py) runs only the engine core: token ids in, token ids
out. Each step's outputs reach a request's RequestStream on the event loop (`put`, via
`call_soon_threadsafe`), where the server's one OutputProcessor turns them into
RequestOutputs at once (incremental detokenization, stop strings, logprobs), as vLLM's
v1 front end does in its API process: a step's host work never includes any request's
text. A stop string found here ends its completion in the core through a `finish`
command, applied between steps; tokens the core sampled meanwhile are dropped, since
the completion already ended.

The handler takes outputs when it is ready (`next`), which is only as fast as its
client reads: a client that stops reading fills the socket, the handler blocks in its
send, and outputs pile up here. They cannot pile up without bound, and the engine is
never held back: each request holds at most one pending output however long its client
stalls. A stream's requests are DELTA (each output carries what is new since the last:
the server's streams, whose per-step work is then O(new tokens)), so a newer output is
merged into the pending one (RequestOutput.add, as vLLM's RequestOutputCollector merges
the deltas of a request nobody reads); a CUMULATIVE output holds everything the older one
did and replaces it; a FINAL_ONLY request (a whole answer) has one output, at the end.
When the client comes back the handler sends everything new in one chunk. Processing on
arrival also means a stalled client's stop string still ends its completion in the core
at once, instead of the request generating to max_tokens while nobody reads. A client
that goes away is aborted by the handler's disconnect watcher (app.py); its pending
output is dropped then. `on_step` (the handler's RequestRecorder) hears of each step that
gave a request tokens as it arrives, whatever the output kind: time to first token and
inter-token latency do not depend on how often the handler gets an output.

Only the event loop thread touches a stream and the OutputProcessor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from paged_jax.core.outputs import RequestOutput
from paged_jax.engine.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"  # first item of a stream whose adds all succeeded


class RequestAborted(Exception):
    """Delivered to a request that its own HTTP side aborted (the client went away)."""


class RequestStream:
    """One HTTP request's engine requests and their outputs, each request's in step order."""

    def __init__(self, owner, request_ids: list[str], processor: OutputProcessor, *,
                 delta_ids: Collection[str] = (), on_step: Callable[[], None] | None = None):
        """`delta_ids`: the requests whose outputs are DELTA (merged while pending, not
        replaced); `on_step()`: called as each engine output of the stream's requests arrives."""
        self._owner, self._processor = owner, processor
        self.request_ids = request_ids
        self._delta_ids = frozenset(delta_ids)
        self._on_step = on_step
        self.unfinished = set(request_ids)  # requests whose final output the handler has not taken
        self.aborted = False  # set by abort(): the outputs stop and the request counts as aborted
        self.num_received = 0  # engine outputs that arrived (for tests and debugging)
        self._latest: dict[str, RequestOutput] = {}  # request id -> its newest output not taken yet
        self._accepted = False
        # delivered instead of outputs (raised once those before it were taken); once set,
        # later arrivals are dropped
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()

    def put(self, item) -> None:
        """On the event loop: one item from the engine loop, ACCEPTED, an exception (the
        request ended without finishing) or an EngineCoreOutput, processed at once."""
        if self._error is not None:
            return
        if isinstance(item, str):
            assert item == ACCEPTED, item
            self._accepted = True
        elif isinstance(item, BaseException):
            self._error = item
        else:
            self.num_received += 1
            if self._on_step is not None:
                self._on_step()
            self._process(item)
        self._wakeup.set()

    def _process(self, item) -> None:
        try:
            processed = self._processor.process([item])
        except Exception as exc:  # a bug in detokenizing or stop checking: this request fails, not the loop
            logger.exception("processing an output of %s failed", item.request_id)
            self._error = exc
            self._owner.abort(sorted(self.unfinished))
            return
        for request_id, index, stop in processed.stopped:
            self._owner.finish_sequence(request_id, index, stop)
        for out in processed.request_outputs:  # none once a stop string ended the request
            pending = self._latest.pop(out.request_id, None)
            if pending is not None and out.request_id in self._delta_ids:
                pending.add(out)  # one pending output with both steps' new text and tokens
                out = pending
            self._latest[out.request_id] = out  # (CUMULATIVE: the newer output holds everything the older did)

    @property
    def num_pending(self) -> int:
        """Outputs waiting for the handler: at most one per engine request."""
        return len(self._latest)

    async def accepted(self) -> None:
        """Wait until the engine took every request; re-raises its ValueError on bad input."""
        while not (self._accepted or self._error is not None):
            await self._wait()
        if not self._accepted:
            error = self._error
            self._forget()  # nothing was queued (a refused group is rolled back)
            raise error

    async def next(self) -> RequestOutput:
        """The newest RequestOutput of one of the stream's requests (the oldest pending one
        first); raises what the engine loop delivered instead, once the outputs before it
        were taken."""
        while True:
            if self._latest:
                request_id = next(iter(self._latest))
                out = self._latest.pop(request_id)
                if out.finished:
                    self.unfinished.discard(request_id)
                return out
            if self._error is not None:
                error = self._error
                self._forget()
                raise error
            await self._wait()

    async def _wait(self) -> None:
        # the caller checked its condition in this same synchronous stretch: no put() can
        # slip in between that check and the clear (put runs on this thread too)
        self._wakeup.clear()
        await self._wakeup.wait()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def abort(self) -> None:
        """Abort whatever has not finished (no-op once everything finished)."""
        if self.unfinished:
            self.aborted = True
            self._owner.abort(sorted(self.unfinished))
            self._forget()
            if self._error is None:  # a handler waiting in next() (the watcher aborted) wakes up to it
                self._error = RequestAborted(", ".join(self.request_ids))
            self._wakeup.set()

    def _forget(self) -> None:
        for request_id in self.request_ids:
            self._processor.abort_request(request_id)
        self.unfinished.clear()
        self._latest.clear()
