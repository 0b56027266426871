"""EngineCore: token ids in, token-level outputs out, one scheduler step at a time.

The part of the engine that owns the KV cache: it sizes it, holds the scheduler, block
manager, runner and statistics, and each `step` schedules, executes and updates. It knows
token ids only. Prompts, text and stop strings are the front end's (processor.py,
output_processor.py), as in vLLM's v1 engine core, so the core runs (and is tested and
simulated) without a tokenizer and a step's host work does not depend on how much text
its sequences have produced. Stop tokens and length end sequences here; a stop string,
found by the front end, ends one through `finish_sequence`.

A request with `SamplingParams(n > 1)` starts as one sequence whose other completions are
forked from it after the prompt (sharing its blocks); a request with `BeamSearchParams`
keeps its beams as sequences that fork and finish as the host-side beam search picks the
next beams each step (beam_orchestration.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from paged_jax.config.engine_config import EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.core.beam_search import BeamSearchParams
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.scheduler_output import SchedulerOutput
from paged_jax.core.sequence import Sequence, SequenceStatus
from paged_jax.engine.beam_orchestration import advance_beams, beam_results
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.engine.core_requests import CoreRequest, RequestBuilder
from paged_jax.engine.kv_sizing import check_capacity, resolve_config
from paged_jax.engine.kv_transfer import PromptKV, export_prompt_kv, import_prompt_kv
from paged_jax.engine.pool_check import PoolChecker
from paged_jax.engine.processor import ProcessedPrompt, int_list, validate_max_tokens, validate_prompt_token_ids
from paged_jax.engine.grammar_matchers import StructuredOutputManager
from paged_jax.engine.stats import EngineStats
from paged_jax.worker.kv_cache import bytes_per_block
from paged_jax.worker.model_runner import DispatchedStep, ModelRunner


def paged_allocator(config: EngineConfig, num_host_blocks: int) -> BlockManager:
    """The paged BlockManager for a resolved `config` (the default `allocator_factory`)."""
    if config.kv_allocator != "paged":  # the engine does not know the baselines: they plug in from above
        raise ValueError(f"kv_allocator={config.kv_allocator!r} is one of the paper's baselines, which plug in "
                         "from above the engine: use paged_jax.LLM, or pass allocator_factory="
                         "paged_jax.entrypoints.allocators.make_allocator to LLMEngine or EngineCore")
    return BlockManager(config.num_blocks, config.block_size, num_host_blocks=num_host_blocks,
                        watermark=config.watermark, enable_prefix_caching=config.enable_prefix_caching)


class _InFlight(NamedTuple):
    """A dispatched step whose tokens the host has not read (async scheduling)."""

    output: SchedulerOutput
    handle: DispatchedStep
    sampled: list[tuple[int, Sequence]]  # (row, sequence) of the chunks that sample (Scheduler.update)
    feed_rows: dict[int, int]  # sequence id -> its row: where the next step finds its token on the device


class EngineCore:
    def __init__(self, model_config: ModelConfig, params, config: EngineConfig, *, runner_factory=ModelRunner,
                 clock=time.monotonic, mesh=None, structured_outputs: StructuredOutputManager | None = None,
                 allocator_factory=paged_allocator, show_progress: bool = False):
        """`params`: the model weights (None for a model-free runner); `mesh`: the device
        mesh the weights are sharded over, for tensor parallelism. `runner_factory`
        (ModelRunner's signature) and `clock` (seconds) are injection points: the simulator
        passes a model-free runner and a virtual clock. `structured_outputs`: the grammar
        matchers of constrained requests (engine/grammar_matchers.py; the front end builds
        it from the tokenizer); without it, a request with structured_outputs is refused.
        `allocator_factory(config, num_host_blocks)`: the KV block allocator (default the
        paged BlockManager; the paper's contiguous baselines come from
        paged_jax/entrypoints/allocators.py, above the engine, which knows only their
        interface). `show_progress`: a bar on stderr over the buckets warm-up compiles."""
        self.model_config = model_config
        self._asked_async = config.async_scheduling  # None: the platform's default
        self.config = resolve_config(config, model_config, check_memory=params is not None)  # model-free: no arrays
        config = self.config
        block_bytes = bytes_per_block(model_config, config.block_size, config.kv_cache_dtype)
        num_host_blocks = config.swap_space_bytes // block_bytes if config.preemption_mode == "swap" else 0
        self.block_manager = allocator_factory(config, num_host_blocks)
        check_capacity(config, self.block_manager)
        self.scheduler = Scheduler(config, self.block_manager)
        self.structured_outputs = structured_outputs
        extra = {"mesh": mesh} if mesh else {}
        if structured_outputs is not None:  # the runner compiles its masked heads too
            extra["structured_outputs"] = True
        self.runner = runner_factory(model_config, params, config, num_blocks=config.num_blocks,
                                     num_host_blocks=num_host_blocks, **extra)
        self._clock = clock
        self.runner.warm_up(progress=show_progress)
        # async scheduling needs a runner that dispatches without waiting (ModelRunner.dispatch); the
        # simulator's model-free runners step in sequence, which the platform's default then gives them
        self.async_scheduling = bool(config.async_scheduling) and callable(getattr(self.runner, "dispatch", None))
        self._cache_resolved_blocks = self.async_scheduling and config.enable_prefix_caching
        if config.async_scheduling and not self.async_scheduling and self._asked_async:
            raise ValueError(f"async_scheduling=True needs a runner with dispatch/fetch; "
                             f"{type(self.runner).__name__} has none")
        self.stats_tracker = EngineStats(self.block_manager, self.scheduler, self.runner,
                                         paper_metrics=config.paper_metrics)
        self.pool_checker = PoolChecker(config.pool_check)  # leaks reported after steps and aborts
        self._requests: dict[str, CoreRequest] = {}
        self._seqs: dict[int, Sequence] = {}
        self._requests_builder = RequestBuilder(model_config, config, self.block_manager, self.runner.num_top_logprobs,
                                                structured_outputs)
        self._prompt_limits = (self.config.max_model_len, model_config.vocab_size)  # validate_prompt_token_ids
        self._num_host_fed = 0  # live requests with host_fed (beam search, structured outputs)
        self._in_flight: _InFlight | None = None  # async scheduling: the step dispatched last, not yet read

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int] | ProcessedPrompt,
                    params: SamplingParams | BeamSearchParams | None = None, *, arrival_time: float | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> None:
        """Queue a request; raises ValueError (and queues nothing) on bad input. `priority`:
        lower is served earlier and preempted later (scheduling_policy="priority" only).
        The prompt's ids are converted and checked here, unless they come as a
        ProcessedPrompt that a Processor checked against this engine's limits."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} requires scheduling_policy='priority' "
                             f"(the engine's is {self.config.scheduling_policy!r})")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be a SamplingParams or BeamSearchParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.config.kv_allocator != "paged" and (isinstance(params, BeamSearchParams) or params.n > 1):
            raise ValueError(f"kv_allocator={self.config.kv_allocator!r} is a baseline without block sharing: "
                             "it serves n=1 sampling only (no n > 1, no beam search)")
        processed = prompt_token_ids if isinstance(prompt_token_ids, ProcessedPrompt) else None
        if processed is not None and processed.checked == self._prompt_limits:
            token_ids = processed.token_ids  # the front end's Processor converted and checked them
        else:  # plain ids, or checked against another engine's limits
            token_ids = int_list(prompt_token_ids if processed is None else processed.token_ids)
            validate_prompt_token_ids(token_ids, *self._prompt_limits)
        validate_max_tokens(len(token_ids), params.max_tokens, self.config.max_model_len)  # no silent clamp
        now = self._clock() if arrival_time is None else arrival_time
        request = self._requests_builder.build(request_id, token_ids, params, now, cache_salt)
        self._num_host_fed += request.host_fed
        self._requests[request_id] = request
        for seq in request.seqs:
            seq.priority = int(priority)  # forked completions and beams inherit it (RequestBuilder.fork_of)
            self._seqs[seq.seq_id] = seq
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks at once (unknown or finished ids: no-op)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._num_host_fed -= request.host_fed
        for seq in request.seqs:
            if not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self._seqs.pop(seq.seq_id, None)
            if self.structured_outputs is not None:
                self.structured_outputs.drop(seq.seq_id)
        self.pool_checker.check(self)

    def finish_sequence(self, request_id: str, index: int, stop_reason: str) -> None:
        """End completion `index` of a request as stopped (the front end found stop string
        `stop_reason` in its text) and free its blocks now; unknown or finished: no-op."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.index == index and not seq.status.finished:
                seq.stop_reason, seq.finish_time = stop_reason, self._clock()
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                self._seqs.pop(seq.seq_id, None)
        if request.finished:
            self._drop(request)
        self.pool_checker.check(self)

    def export_prompt_kv(self, prompt_token_ids, *, cache_salt: str | None = None) -> PromptKV | None:
        """The K/V of the prompt's blocks in this engine's prefix cache (kv_transfer.py)."""
        self._require_kv_transfer()
        return export_prompt_kv(self.block_manager, self.runner, prompt_token_ids, cache_salt=cache_salt)

    def import_prompt_kv(self, kv: PromptKV) -> int:
        """Adopt another engine's prompt K/V into this one's prefix cache (kv_transfer.py);
        returns the blocks written. Call it right before adding the request."""
        self._require_kv_transfer()
        scratch = self._requests_builder.next_seq_id
        self._requests_builder.next_seq_id += 1
        written = import_prompt_kv(self.block_manager, self.runner, kv, scratch)
        self.stats_tracker.num_imported_blocks += written
        return written

    def _require_kv_transfer(self) -> None:
        if not self.config.kv_transfer:
            raise ValueError("this engine was built without kv_transfer=True (EngineConfig): it moves no prompt K/V")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def has_request(self, request_id: str) -> bool:
        """Whether the request is queued or running (not finished, aborted or unknown)."""
        return request_id in self._requests

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (e.g. between benchmark runs); returns how many."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> dict:
        return {**self.stats_tracker.as_dict(), "num_pool_check_failures": self.pool_checker.num_failures}

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run one jitted step, and return the requests that moved or finished
        (beam searches: only once done). With async scheduling, the step scheduled now runs
        on the device while the host reads and processes the one before, whose outputs
        this returns (`_step_async`)."""
        if self.async_scheduling:
            return self._step_async()
        host_start = time.perf_counter()
        output = self._schedule()
        if output is None:
            return []
        device_before = self.runner.device_seconds
        result = self.runner.execute(output, self._seqs, **self._bitmask(output))
        outputs = self._process(output, result, self.scheduler.update(output, self._seqs))
        self.stats_tracker.record_step(output, time.perf_counter() - host_start,
                                       self.runner.device_seconds - device_before)
        self.pool_checker.check(self)
        return outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        """vLLM v1's async scheduling: schedule and dispatch step N+1 while step N runs, then
        read and process N. A sequence N sampled for is scheduled in N+1 with its token
        pending (`Sequence.num_pending`): the device feeds N's token to N+1 (the runner's
        token feed), so N+1 never waits for the host. Stop checks and outputs therefore lag
        one step: a sequence that N finished may have run in N+1 too, and whatever N+1
        sampled for it is dropped (`_process`); its blocks were freed once, by N's
        processing, and no step dispatched after N+1 reads them before N+1 wrote them (the
        device runs steps in order). Steps with rows that need their tokens on the host
        before the next step can be scheduled (beam search picks the next beams on the
        host; a structured-output row's next bitmask needs its token) are read at once,
        as without async scheduling (`_needs_tokens_now`)."""
        host_start = time.perf_counter()
        previous = self._in_flight
        output = self._schedule()  # while `previous` runs
        self._in_flight = None
        step = None
        if output is not None:
            device_before = self.runner.device_seconds
            feed_rows = previous.feed_rows if previous is not None else None
            handle = self.runner.dispatch(output, self._seqs, feed_rows=feed_rows, **self._bitmask(output))
            sampled = self.scheduler.update(output, self._seqs)
            for _, seq in sampled:
                seq.num_pending += 1
            step = _InFlight(output, handle, sampled, {seq.seq_id: row for row, seq in sampled})
        outputs = []
        if previous is not None:
            outputs = self._process(previous.output, self.runner.fetch(previous.handle), previous.sampled)
        if step is not None:
            if self._needs_tokens_now(output):
                outputs += self._process(output, self.runner.fetch(step.handle), step.sampled)
            else:
                self._in_flight = step
            self.stats_tracker.record_step(output, time.perf_counter() - host_start,
                                           self.runner.device_seconds - device_before)
        self.pool_checker.check(self)
        return outputs

    def _schedule(self):
        """The scheduler's next step, or None when it schedules nothing."""
        output = self.scheduler.schedule()
        self.stats_tracker.record_schedule(output)
        if output.is_empty:
            # a step that schedules nothing changes nothing, unless the step in flight does
            if self.scheduler.has_unfinished() and self._in_flight is None:
                raise RuntimeError(f"the scheduler cannot make progress: {self.stats()}")
            return None
        return output

    def _bitmask(self, output) -> dict:
        """The runner's token_bitmask argument for a step with structured-output rows: a
        function the runner calls when it needs the mask (off CPU, while its model step runs)."""
        so = self.structured_outputs
        if so is not None and so.has_constrained_rows(output.chunks, self._seqs):
            return {"token_bitmask": lambda: so.bitmask(output.chunks, self._seqs)}
        return {}

    def _needs_tokens_now(self, output) -> bool:
        """Whether a row of `output` belongs to a beam search or a structured-output request:
        their next step needs this step's tokens on the host (`_step_async`)."""
        if not self._num_host_fed:
            return False
        for chunk in output.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is not None and self._requests[seq.request_id].host_fed:
                return True
        return False

    def _process(self, output, result, sampled) -> list[EngineCoreOutput]:
        """Append what a step sampled to its sequences and build the requests' outputs.
        `sampled`: (row, sequence) of the chunks that sampled (Scheduler.update). Sequences
        finished or dropped since the step was scheduled (async scheduling) are skipped."""
        now = self._clock()
        if result.prompt is not None:
            self._record_prompt_logprobs(output, result.prompt)
        moved: dict[str, list[CompletionDelta]] = {}
        for row, seq in sampled:
            if seq.num_pending:
                seq.num_pending -= 1
            if seq.status.finished:  # stopped by the step before, a stop string, or an abort
                continue
            request = self._requests[seq.request_id]
            deltas = moved.setdefault(seq.request_id, [])
            if seq.first_token_time is None:
                seq.first_token_time = now
            if request.beam is not None:
                seq.beam_candidates = list(zip(result.top_ids[row].tolist(), result.top_logprobs[row].tolist()))
            else:
                deltas.append(self._append_token(request, seq, result, row, now))
        outputs = []
        for request_id, deltas in moved.items():
            request = self._requests[request_id]
            if request.beam is not None:
                if all(s.beam_candidates is not None for s in request.seqs):
                    self._advance_beams(request)
                if not request.finished:
                    continue  # beams are reported once the search is done
                deltas = beam_results(request.beam, request.stop_ids)
            outputs.append(EngineCoreOutput(request_id, deltas, request.finished, now, request.arrival_time,
                                            request.first_token_time, request.root.num_cached_tokens,
                                            request.pending_prompt_logprobs or None))
            request.pending_prompt_logprobs = []
            if request.finished:
                self._drop(request)
        return outputs

    def _append_token(self, request: CoreRequest, seq: Sequence, result, row: int, now: float) -> CompletionDelta:
        token = int(result.tokens[row])
        seq.output_token_ids.append(token)
        known = seq.num_known_tokens
        if self._cache_resolved_blocks and known % self.config.block_size == 0 and seq.num_computed_tokens >= known:
            self.block_manager.cache_known_blocks(seq.seq_id, seq.token_ids, known)  # a block whose K/V it completed
        # the runner computes logprobs only for a batch with a row that asked for them (else its logprob slot
        # holds the raw logit): a completion that did not ask gets None, as in vLLM, never a value that
        # depends on its batch neighbours
        new_logprobs = cumulative = top = None
        if request.params.logprobs is not None:
            logprob = float(result.logprobs[row])
            seq.cumulative_logprob += logprob
            new_logprobs, cumulative = [logprob], seq.cumulative_logprob
        if request.params.logprobs:
            top = [list(zip(result.top_ids[row].tolist(), result.top_logprobs[row].tolist()))[: request.params.logprobs]]
        status = None
        stop_token = token in request.stop_ids  # not fed to a grammar matcher (vLLM's way with EOS)
        grammar_end = (self.structured_outputs.accept(seq, token)
                       if self.structured_outputs is not None and not stop_token else None)
        if stop_token:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif grammar_end is not None:  # complete (vLLM: stop), or the matcher failed ("error", logged)
            status = grammar_end
        elif (len(seq.output_token_ids) >= request.params.max_tokens
              or seq.num_tokens >= self.config.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            seq.finish_time = now
            self.scheduler.finish(seq, status)
        return CompletionDelta(seq.index, [token], new_logprobs, top, cumulative,
                               status.value if status is not None else None, seq.stop_reason)

    def _record_prompt_logprobs(self, output, prompt) -> None:
        """Queue each scored prompt position on its request (sent with its next output).
        Positions come in order; after a recompute preemption a prefill scores its prompt
        again, and positions already reported are skipped."""
        for i, row in enumerate(prompt.rows.tolist()):
            seq = self._seqs.get(output.chunks[row].seq_id)
            if seq is None:  # dropped since the step was scheduled (async scheduling)
                continue
            index = int(prompt.positions[i]) + 1  # the prompt token scored
            if index <= seq.num_prompt_logprobs:
                continue
            if index != seq.num_prompt_logprobs + 1:
                raise AssertionError(f"prompt logprobs out of order: position {index} after "
                                     f"{seq.num_prompt_logprobs}")
            request = self._requests[seq.request_id]
            k = request.params.prompt_logprobs
            top = list(zip(prompt.top_ids[i, :k].tolist(), prompt.top_logprobs[i, :k].tolist()))
            request.pending_prompt_logprobs.append((seq.prompt_token_ids[index], float(prompt.logprobs[i]),
                                                    int(prompt.ranks[i]), top))
            seq.num_prompt_logprobs = index

    def _advance_beams(self, request: CoreRequest) -> None:
        step = advance_beams(request.beam, request.seqs, self.scheduler, self._requests_builder.fork_of)
        for seq in step.forked:
            self._seqs[seq.seq_id] = seq
        for seq in step.dropped:
            self._seqs.pop(seq.seq_id, None)
        request.seqs = step.beams

    def _drop(self, request: CoreRequest) -> None:
        del self._requests[request.request_id]
        self._num_host_fed -= request.host_fed
        for seq in request.seqs:
            self._seqs.pop(seq.seq_id, None)
            if self.structured_outputs is not None:
                self.structured_outputs.drop(seq.seq_id)
