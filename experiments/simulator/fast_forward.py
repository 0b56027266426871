"""Fast-forward: a simulated engine's steps at the cost of their events, not their rows.

Why: a long simulation runs millions of steps, and each `engine.step()` costs the
engine's full per-sequence Python (scheduling, block table updates, per-row outputs,
stats: ~20 us per sequence-step on a slow core) although with the simulator's runner
most of what a step changes is known in advance. `FastForward.advance` applies
steps until a request arrives (or a step needs the real engine), in three ways:

- runs of steps whose running sequences all decode but maybe the last, which may
  prefill (`LazyRun`, lazy_run.py): O(1) per step plus its events (a block added or
  filled, an admission, a finish, a preemption), whatever mix of them the step has,
  through the scheduler's own pieces (`Scheduler.num_new_tokens` for a chunk,
  `preempt_last` for the victim, `admit_waiting` for its third phase) and the engine's
  length check; decoding rows are brought up to date only where something reads them;
- the rest (swapped sequences coming back, an empty running queue, under priority a
  chunked prefill admitted before the tail): the real
  `schedule()`, stats and sequence updates, without the runner and per-row outputs
  (`_lean_step`), if no sequence it may schedule can finish in it; else the real
  `engine.step()`.

Finishes go through the core's public `abort_request` (a plain request is one
sequence: its blocks are freed and the request forgotten as a length finish in step()
does; the sequence is then marked finished by length), the requests' final outputs
through the real front end; no SchedulerOutput, runner or per-row outputs.
Exactness (tests/experiments/test_fast_forward.py compares every request's times, the
stats and the block tables at every schedule() call against step-by-step runs): block
allocations are made by the real block manager in the real order (running order, then
admissions), so block ids, prefix-cache registrations and evictions are the engine's.
Finished sequences' blocks are freed in row order, as update() frees them. The
sequences finished by a step are taken off the scheduler (`take_finished_ids`) by the
next step applied without schedule(), as that step's schedule() would report them to a
runner (the simulator's keeps no tables). The front end gets, per sequence, one delta
of all the tokens it sampled in the steps applied (a finished one's at its last step's
time), which its accumulation makes the same as one delta per step.

Preconditions (checked; anything else runs through `_lean_step` or step by step): the
simulator's own requests (one greedy completion, ignore_eos, no stop strings or
tokens, no logprobs: `_plain`), the paged block manager, no structured outputs,
nothing swapped.
"""

from __future__ import annotations

import itertools
import time

from paged_jax.core.block_manager import BlockManager
from paged_jax.core.sequence import SequenceStatus
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from experiments.simulator.lazy_run import LazyRun
from experiments.simulator.step_time_model import step_features


class FastForward:
    def __init__(self, engine, clock, step_model, token_id: int, buckets=()):
        """`engine`: the simulator's LLMEngine; `clock`: its VirtualClock; `step_model`
        and `buckets` ((seq_buckets, token_buckets) or ()): what its SimulatedRunner
        charges per step; `token_id`: what that runner samples."""
        self._engine, self._clock, self._model = engine, clock, step_model
        self._token, self._buckets = token_id, buckets
        self.num_steps = 0  # steps applied without schedule() so far (LazyRun)
        self.num_prefill_steps = 0  # of those, steps with a prefill chunk (of 2+ tokens)
        self.num_preempting_steps = 0  # of those, steps that preempted (recompute or swap)
        self.num_admitting_steps = 0  # of those, steps that admitted waiting sequences
        self.num_finishing_steps = 0  # of those, steps that finished requests
        self.num_lean_steps = 0  # steps run through the real schedule() without engine.step()
        self.num_runs = 0  # advance() calls that fast-forwarded at least one step
        self.num_last_applied = 0  # steps the last advance() call applied (0: the caller must engine.step())
        self._plain_ids: set[int] = set()  # sequences _eligible found plain
        # why each advance() call stopped (experiments/profile_simulator.py reports it):
        # arrival; or the last LazyRun's end (idle: nothing running; swapped: a swap
        # preemption; not_plain: a waiting request the fast-forward does not step;
        # inserted: an admission before the tail) or not_eligible, where neither the
        # fast-forward nor _lean_step could apply the next step
        self.run_ends: dict[str, int] = {}
        self.runs_resumed: dict[str, int] = {}  # why a LazyRun ended inside advance(), which went on

    def _eligible(self, running) -> bool:
        """The engine-wide preconditions (module docstring) and the simulator's plain
        requests (`_plain`, remembered per sequence: its parameters do not change)."""
        core = self._engine.core
        config = core.config
        n = len(running)
        if (not n or core.scheduler.swapped or n > config.max_num_seqs or n > config.max_num_batched_tokens
                or type(core.block_manager) is not BlockManager or core.structured_outputs is not None):
            return False
        plain = self._plain_ids
        for seq in running:
            if seq.seq_id not in plain:
                if not self._plain(seq):
                    return False
                plain.add(seq.seq_id)
        return True

    @staticmethod
    def _plain(seq) -> bool:
        """One greedy completion, ignore_eos, no stops, logprobs or forks."""
        p = seq.sampling_params
        return not (p.stop or p.stop_token_ids or not p.ignore_eos or p.logprobs is not None or p.n != 1
                    or p.prompt_logprobs is not None or seq.pending_forks)

    @staticmethod
    def _decoding(seq) -> bool:
        return seq.num_computed_tokens == seq.num_tokens - 1 and seq.first_token_time is not None

    def _lazy_shape(self, running) -> bool:
        """Every running sequence decodes but maybe the last (LazyRun's precondition)."""
        return all(self._decoding(seq) for seq in itertools.islice(running, len(running) - 1))

    def _remaining(self, seq) -> int:
        """Tokens a decoding `seq` has left to sample: the step that samples the last one
        (reaching max_tokens or max_model_len) finishes it."""
        limit = self._engine.core.config.max_model_len
        return min(seq.sampling_params.max_tokens - len(seq.output_token_ids), limit - seq.num_tokens)

    def _steps_left(self, seq) -> int:
        """Steps a decoding `seq` runs before the one that finishes it."""
        return self._remaining(seq) - 1

    def advance(self, next_arrival: float, progress=None) -> list:
        """Apply steps until a request arrives at `next_arrival` or a step needs the real
        engine.step(): runs of steps directly (LazyRun), the other steps through the
        real scheduler (`_lean_step`) where they can finish nothing;
        returns the RequestOutputs of the requests that finished in them, as
        engine.step() would have. `progress(n)`, if given, is called as n finish (a
        trace whose requests all arrive at once runs in one call)."""
        start = time.perf_counter()
        core = self._engine.core
        sched = core.scheduler
        self._pending: dict = {}  # sequence -> tokens sampled in these steps, reported at the end
        self._finished: list = []  # RequestOutputs of requests finished in these steps
        self._progress = progress
        k, end = 0, "arrival"
        while self._clock.now < next_arrival:
            running = sched.running
            end = "not_eligible"
            if self._eligible(running):
                if self._lazy_shape(running) and self._waiting_plain():
                    run, end = LazyRun(self), None
                    while self._clock.now < next_arrival and end is None:
                        end = run.apply()
                    run.finish_run()
                    k += run.step
                    if self._clock.now >= next_arrival:
                        end = "arrival"
                        break
                    if run.step:  # a swapped group, a non-plain waiting head or a priority insertion: look again
                        self.runs_resumed[end] = self.runs_resumed.get(end, 0) + 1
                        continue
            if end == "arrival" or not self._lean_step():
                break
            k += 1
            self.num_lean_steps += 1
        if k:
            self._emit()
            core.pool_checker.check(core)
            core.stats_tracker.add_host_seconds(time.perf_counter() - start)
            self.num_runs += 1
        self.num_last_applied = k
        self._ended(end)
        return self._finished

    def _waiting_plain(self) -> bool:
        """Whether the waiting sequences a step may admit (at most max_num_seqs) are the
        simulator's plain requests (LazyRun admits only those)."""
        sched = self._engine.core.scheduler
        return all(self._plain(seq) for seq in itertools.islice(sched.waiting, self._engine.core.config.max_num_seqs))

    def _could_finish(self, seq) -> bool:
        """Whether `seq` may finish in the next step if scheduled (its next token reaches
        max_tokens or max_model_len), or is not one of the simulator's plain requests."""
        return not self._plain(seq) or self._steps_left(seq) <= 0

    def _lean_step(self) -> bool:
        """One step as engine.step() runs it (the real schedule(), stats and sequence
        updates; the SimulatedRunner's clock), minus the runner and the per-row outputs
        (its tokens join `_pending`), if no sequence it may schedule can finish in it;
        False (nothing done) otherwise, or if it is not the simulator's kind of engine."""
        core = self._engine.core
        config, sched, stats = core.config, core.scheduler, core.stats_tracker
        if (type(core.block_manager) is not BlockManager or core.structured_outputs is not None
                or not sched.has_unfinished()):
            return False
        if any(self._could_finish(seq) for seq in sched.running):
            return False
        room = config.max_num_seqs - len(sched.running)  # sequences it may admit or swap in
        for group in itertools.islice(sched.swapped, room):
            if any(self._could_finish(seq) for seq in group):
                return False
        if any(self._could_finish(seq) for seq in itertools.islice(sched.waiting, room)):
            return False
        output = sched.schedule()
        stats.record_schedule(output)
        if output.is_empty:
            raise RuntimeError(f"the scheduler cannot make progress: {core.stats()}")
        self._clock.now += self._model.seconds(*step_features(output, *self._buckets))
        now = self._clock.now
        for _, seq in sched.update(output, {seq.seq_id: seq for seq in sched.running}):
            seq.output_token_ids.append(self._token)
            if seq.first_token_time is None:  # as step() sets it (its request's is its first sequence's)
                seq.first_token_time = now
            self._pending[seq] = self._pending.get(seq, 0) + 1
        stats.record_step(output, 0.0, 0.0)
        return True

    def _emit(self) -> None:
        """The front end's view of the steps just applied: one delta of all the simulated
        tokens each sequence sampled in them (its accumulation makes that k deltas of one)."""
        now = self._clock.now
        processed = self._engine.output_processor.process([
            EngineCoreOutput(seq.request_id, [CompletionDelta(seq.index, [self._token] * c, None, None, None, None)],
                             False, now, seq.arrival_time, seq.first_token_time, seq.num_cached_tokens)
            for seq, c in self._pending.items()])
        if processed.request_outputs or processed.stopped:
            raise AssertionError("a fast-forwarded step finished a request")

    def _finish(self, done) -> None:
        """End `done` (running order, as the step's update() ends them: their blocks go
        to the free queue in that order) at the clock's time, and report their requests'
        final outputs, all the tokens the fast-forward sampled for them included."""
        now = self._clock.now
        self.num_finishing_steps += 1
        outputs = []
        core = self._engine.core
        for seq in done:
            # ended by length as step() ends it: its blocks freed now, the request forgotten. The final output
            # is built here, so the core's part is abort_request's (a plain request is one sequence)
            seq.finish_time = now
            core.abort_request(seq.request_id)
            seq.status = SequenceStatus.FINISHED_LENGTH
            c = self._pending.pop(seq, 0)
            outputs.append(EngineCoreOutput(
                seq.request_id, [CompletionDelta(seq.index, [self._token] * c, None, None, None,
                                                 SequenceStatus.FINISHED_LENGTH.value)],
                True, now, seq.arrival_time, seq.first_token_time, seq.num_cached_tokens))
        processed = self._engine.output_processor.process(outputs)
        if processed.stopped or len(processed.request_outputs) != len(done):
            raise AssertionError("the front end did not finish the requests the fast-forward finished")
        self._finished.extend(processed.request_outputs)
        if self._progress is not None:
            self._progress(len(done))

    def _ended(self, reason: str) -> None:
        self.run_ends[reason] = self.run_ends.get(reason, 0) + 1
