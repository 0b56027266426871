"""The asyncio side of one HTTP request: the engine core's outputs become RequestOutputs.

The engine thread (engine_loop.py) runs only the engine core: token ids in, token ids
out. Each step's outputs reach a request's RequestStream through its asyncio queue, and
the stream turns them into RequestOutputs with the server's one OutputProcessor
(incremental detokenization, stop strings, logprobs) in the handler's own task on the
event loop, as vLLM's v1 front end does in its API process. So a step's host work does
not include any request's text, and a long detokenization delays only its own request.
A stop string found here ends its completion in the core through a `finish` command,
applied between steps; tokens the core sampled meanwhile are dropped, since the
completion already ended.

Only the event loop thread touches a stream and the OutputProcessor.
"""

from __future__ import annotations

import asyncio

from paged_jax.core.outputs import RequestOutput
from paged_jax.engine.output_processor import OutputProcessor

ACCEPTED = "accepted"  # first item of a stream whose adds all succeeded


class RequestStream:
    """One HTTP request's engine requests and their outputs, in step order."""

    def __init__(self, owner, request_ids: list[str], queue: asyncio.Queue, processor: OutputProcessor):
        self._owner, self._queue, self._processor = owner, queue, processor
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self.aborted = False  # set by abort(): the outputs stop and the request counts as aborted

    async def accepted(self) -> None:
        """Wait until the engine took every request; re-raises its ValueError on bad input."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._forget()  # nothing was queued (a refused group is rolled back)
            raise item
        assert item == ACCEPTED, item

    async def next(self) -> RequestOutput:
        """The next RequestOutput of any of the stream's requests; raises what the engine
        loop delivered instead."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._forget()
                raise item
            processed = self._processor.process([item])
            for request_id, index, stop in processed.stopped:
                self._owner.finish_sequence(request_id, index, stop)
            for out in processed.request_outputs:  # none once a stop string ended the request
                if out.finished:
                    self.unfinished.discard(out.request_id)
                return out

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def abort(self) -> None:
        """Abort whatever has not finished (no-op once everything finished)."""
        if self.unfinished:
            self.aborted = True
            self._owner.abort(sorted(self.unfinished))
            self._forget()

    def _forget(self) -> None:
        for request_id in self.request_ids:
            self._processor.abort_request(request_id)
        self.unfinished.clear()
