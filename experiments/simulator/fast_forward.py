"""Fast-forward: a simulated engine's steps at the cost of their events, not their rows.

Why: a long simulation runs millions of steps, and each `engine.step()` costs the
engine's full per-sequence Python (scheduling, block table updates, per-row outputs,
stats: ~20 us per sequence-step on a slow core) although with the simulator's runner
most of what a step changes is known in advance. `FastForward.advance` applies
steps until a request arrives (or a step needs the real engine), in three ways:

- quiet runs (every running sequence decodes one token; nobody is admitted, preempted or
  finished): O(1) per step plus one `allocate_slots` call per block that fills or is
  added, the stats' figures tracked incrementally with `kv_waste`'s formulas;
- any other step of plain sequences with nothing swapped (`_step`: prefill chunks,
  preemption, admission, finishes): O(rows), schedule()'s rules through the scheduler's
  own pieces (`Scheduler.num_new_tokens` for each row's chunk, `preempt_last` for the
  victim, `admit_after` for its third phase), the engine's update and length check,
  finishes through the core (`EngineCore.finish_by_length`), the requests' final
  outputs from the real front end; no SchedulerOutput, runner or per-row outputs;
- the rest (swapped sequences coming back, an empty running queue): the real
  `schedule()`, stats and sequence updates, without the runner and per-row outputs
  (`_lean_step`), if no sequence it may schedule can finish in it; else the real
  `engine.step()`.

Exactness (tests/experiments/test_fast_forward.py compares every request's times, the
stats and the block tables at every schedule() call against step-by-step runs): block
allocations are made by the real block manager in the real order (step by step,
running order, then admissions), so block ids, prefix-cache registrations and
evictions are the engine's; a quiet run stops before a step if a request arrives by
then, a sequence would finish in it or, after its allocations, the scheduler would
admit the waiting head (`Scheduler.would_admit_after`, its own admission test; the
`_step` that follows finds its allocations made). Finished sequences' blocks are freed
in row order, as update() frees them. The KV figures of `_step`s come from the stats'
own `record_schedule`; the sequences finished by a step are taken off the scheduler
(`take_finished_ids`) by the next step applied without schedule(), as that step's
schedule() would report them to a runner (the simulator's keeps no tables). The front
end gets, per sequence, one delta of all the tokens it sampled in the steps applied
(a finished one's at its last step's time), which its accumulation makes the same as
one delta per step.

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
from experiments.simulator.step_time_model import step_features
from paged_jax.worker.batch_inputs import batch_shape


class FastForward:
    def __init__(self, engine, clock, step_model, token_id: int, buckets=()):
        """`engine`: the simulator's LLMEngine; `clock`: its VirtualClock; `step_model`
        and `buckets` ((seq_buckets, token_buckets) or ()): what its SimulatedRunner
        charges per step; `token_id`: what that runner samples."""
        self._engine, self._clock, self._model = engine, clock, step_model
        self._token, self._buckets = token_id, buckets
        self.num_steps = 0  # steps applied without schedule() so far (quiet runs and _step)
        self.num_prefill_steps = 0  # of those, steps with a prefill chunk (of 2+ tokens)
        self.num_preempting_steps = 0  # of those, steps that preempted (recompute or swap)
        self.num_admitting_steps = 0  # of those, steps that admitted waiting sequences
        self.num_finishing_steps = 0  # of those, steps that finished requests
        self.num_lean_steps = 0  # steps run through the real schedule() without engine.step()
        self.num_runs = 0  # advance() calls that fast-forwarded at least one step
        self._plain_ids: set[int] = set()  # sequences _eligible found plain
        # why each advance() call stopped (experiments/profile_simulator.py reports it):
        # arrival, or the last quiet run's end (finish: a sequence's last token is next;
        # not_quiet, preempt or admit) where the step after it could not be applied
        self.run_ends: dict[str, int] = {}

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
        engine.step(): quiet runs and the step after each directly (`_step`), steps with
        swapped sequences or none running through the real scheduler (`_lean_step`);
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
            running = list(sched.running)
            end = "not_quiet"
            if self._eligible(running):
                if all(self._decoding(seq) for seq in running):
                    run, end = self._decode_run(running, next_arrival)
                    k += run
                    self.num_steps += run
                if self._clock.now >= next_arrival:
                    end = "arrival"  # a run that ended at its last quiet step may end past it
                elif self._waiting_plain(len(running)):
                    self._step()  # one that prefills, preempts, admits or finishes
                    k += 1
                    self.num_steps += 1
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
        self._ended(end)
        return self._finished

    def _waiting_plain(self, num_running: int) -> bool:
        """Whether the waiting sequences a step with `num_running` running ones may admit
        are the simulator's plain requests (`_step` admits only those)."""
        sched = self._engine.core.scheduler
        room = self._engine.core.config.max_num_seqs - num_running
        return all(self._plain(seq) for seq in itertools.islice(sched.waiting, room))

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
            core.record_first_token(seq, now)
            self._pending[seq] = self._pending.get(seq, 0) + 1
        stats.record_step(output, 0.0, 0.0)
        return True

    def _step(self) -> None:
        """One step as schedule() and the engine's update run it, for plain sequences with
        nothing swapped: in running order each sequence gets the tokens the budget leaves
        it (Scheduler.num_new_tokens: a decode 1, a prefill what is missing or, chunked,
        what fits) and grows to hold them; where the blocks run out the scheduler preempts
        its choice (Scheduler.preempt_last) until the sequence fits or is itself
        preempted; unless something was, the scheduler's third phase admits what it
        admits (Scheduler.admit_after); then the step's time and stats, each row's
        progress and token where its chunk reaches its end, and the sequences that
        sampled their last token finish, in row order. The caller checked the
        preconditions (`_eligible`, `_waiting_plain`)."""
        core = self._engine.core
        sched, bm, stats, config = core.scheduler, core.block_manager, core.stats_tracker, core.config
        sched.take_finished_ids()
        rows, running, i, preempted = [], sched.running, 0, False
        budget = config.max_num_batched_tokens
        while i < len(running) and budget > 0 and len(rows) < config.max_num_seqs:
            seq = running[i]
            num_new = sched.num_new_tokens(seq, budget)
            if num_new:
                orders = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new, tokens=seq.token_ids)
                while orders is None:
                    victims, _ = sched.preempt_last(i)
                    preempted = True
                    if seq in victims:
                        break
                    orders = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new, tokens=seq.token_ids)
                if orders is None:
                    break  # it was preempted, and everything after it
                if orders:
                    raise AssertionError("a plain sequence's allocation copied a block")
                rows.append((seq, num_new))
                budget -= num_new
            i += 1
        if not rows and preempted:  # schedule() would go on to admit: a lone sequence always fits its pool
            raise AssertionError("a step preempted every running sequence")
        for seq, _ in rows:
            bm.table_update(seq.seq_id)
        num_tokens, admitted = config.max_num_batched_tokens - budget, []
        if not preempted:
            waiting = {seq.seq_id: seq for seq in itertools.islice(sched.waiting, config.max_num_seqs - len(rows))}
            admitted = [(waiting[chunk.seq_id], chunk.num_tokens) for chunk in sched.admit_after(len(rows), num_tokens)]
            rows += admitted
            num_tokens += sum(n for _, n in admitted)
        if not rows:
            raise RuntimeError(f"the scheduler cannot make progress: {core.stats()}")
        stats.record_schedule(None)
        context = sampled = 0
        for seq, n in rows:
            context += seq.num_computed_tokens + n
            sampled += seq.num_computed_tokens + n == seq.num_tokens
        stats.record_step_shape(len(rows), num_tokens, sampled)
        num_seqs = len(rows)
        if self._buckets:
            num_seqs, num_tokens = batch_shape(*self._buckets, num_seqs, num_tokens)
        self._clock.now += self._model.seconds(num_tokens, num_seqs, context)
        now, done = self._clock.now, []
        limit = config.max_model_len
        prefills = False
        for seq, n in rows:
            seq.num_computed_tokens += n
            prefills |= n > 1
            if seq.num_computed_tokens == seq.num_tokens:  # its chunk reached the end: it sampled
                if seq.first_token_time is None:
                    core.record_first_token(seq, now)
                seq.output_token_ids.append(self._token)
                self._pending[seq] = self._pending.get(seq, 0) + 1
                if len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= limit:
                    done.append(seq)  # the engine's length check (plain requests have no stops)
        self.num_prefill_steps += prefills
        self.num_preempting_steps += preempted
        self.num_admitting_steps += bool(admitted)
        if done:
            self._finish(done)

    def _emit(self) -> None:
        """The front end's view of the steps just applied: one delta of all the simulated
        tokens each sequence sampled in them (its accumulation makes that k deltas of one)."""
        now = self._clock.now
        processed = self._engine.output_processor.process([
            EngineCoreOutput(seq.request_id, [CompletionDelta(seq.index, [self._token] * c, [0.0] * c, None,
                                                              seq.cumulative_logprob, None)],
                             False, now, seq.arrival_time, seq.first_token_time, seq.num_cached_tokens)
            for seq, c in self._pending.items()])
        if processed.request_outputs or processed.stopped:
            raise AssertionError("a fast-forwarded step finished a request")

    def _decode_run(self, running, next_arrival: float) -> tuple[int, str]:
        """Quiet steps (the caller checked that every running sequence decodes and the
        preconditions hold), O(1) per step plus one
        allocate_slots per block that fills or is added (module docstring); returns
        (steps, why the run stopped)."""
        core = self._engine.core
        sched, bm, stats = core.scheduler, core.block_manager, core.stats_tracker
        k_max = min(self._steps_left(seq) for seq in running)
        if k_max <= 0 or next_arrival <= self._clock.now:
            return 0, ("finish" if k_max <= 0 else "arrival")
        n, bs = len(running), bm.block_size
        caching = bm.enable_prefix_caching
        computed = [seq.num_computed_tokens for seq in running]
        outputs = [len(seq.output_token_ids) for seq in running]
        finals = [seq.final_num_tokens for seq in running]
        slots = [bm.num_blocks_needed(c) * bs for c in computed]
        # sequences whose step j adds a block ((c + j) % bs == 0) or, with prefix caching,
        # fills one ((c + j + 1) % bs == 0: it is registered), in running order, by j % bs
        grows: dict[int, list[int]] = {}
        events: dict[int, list[int]] = {}
        for i, c in enumerate(computed):
            grows.setdefault(-c % bs, []).append(i)
            events.setdefault(-c % bs, []).append(i)
            if caching and bs > 1:
                events.setdefault(-(c + 1) % bs, []).append(i)
        for phase in events:
            events[phase].sort()
        if caching:  # a block's registration reads its tokens: the run's tokens are there first
            for seq in running:
                seq.output_token_ids.extend([self._token] * k_max)
        held, held_by_seqs = bm.num_tokens_held(), sum(computed)
        without_sharing = bm.num_blocks_without_sharing()
        reserved = sum(min(f, s) for f, s in zip(finals, slots))  # kv_waste: sum of min(final, slots)
        internal = sum(max(s - f, 0) for f, s in zip(finals, slots))
        context = sum(computed) + n  # a step's context tokens: each row attends to start + 1
        if self._buckets:
            num_seqs, num_tokens = batch_shape(*self._buckets, n, n)
        else:
            num_seqs, num_tokens = n, n
        k, handover, end = 0, False, "finish"
        while k < k_max:
            if self._clock.now >= next_arrival:
                end = "arrival"
                break
            phase = k % bs
            grown = grows.get(phase, ())
            if len(grown) > bm.num_free_blocks:
                end = "preempt"
                break  # a sequence could not grow: the real step preempts
            for i in events.get(phase, ()):
                seq = running[i]
                if bm.allocate_slots(seq.seq_id, computed[i] + k + 1, tokens=seq.token_ids) != []:
                    raise AssertionError("a quiet step's allocation failed or copied a block")
            if sched.would_admit_after(n, n):
                handover, end = True, "admit"  # the real step runs it; its allocations are made already
                break
            sched.take_finished_ids()  # what this step's schedule() would report (the runner keeps no tables)
            for i in grown:
                bm.table_update(running[i].seq_id)  # the runner's table update, as _add_chunk takes it
                old, slots[i] = slots[i], slots[i] + bs
                reserved += min(finals[i], slots[i]) - min(finals[i], old)
                internal += max(slots[i] - finals[i], 0) - max(old - finals[i], 0)
            without_sharing += len(grown)
            held += n
            held_by_seqs += n
            stats.record_decode_step(n, slots=bm.num_slots_allocated(), held=held,
                                     waste={"internal": internal, "reservation": reserved - held_by_seqs,
                                            "external": 0},
                                     blocks_without_sharing=without_sharing, step_seconds=0.0)
            self._clock.now += self._model.seconds(num_tokens, num_seqs, context + k * n)
            k += 1
        for i, seq in enumerate(running):
            if caching:
                del seq.output_token_ids[outputs[i] + k:]
            else:
                seq.output_token_ids.extend([self._token] * k)
            seq.num_computed_tokens = computed[i] + k
            # the count a step-by-step run leaves (a handed-over step: its own allocation's)
            bm.allocate_slots(seq.seq_id, computed[i] + k + handover, tokens=seq.token_ids)
        if k:
            for seq in running:
                self._pending[seq] = self._pending.get(seq, 0) + k
        return k, end

    def _finish(self, done) -> None:
        """End `done` (running order, as the step's update() ends them: their blocks go
        to the free queue in that order) at the clock's time, and report their requests'
        final outputs, all the tokens the fast-forward sampled for them included."""
        now = self._clock.now
        self.num_finishing_steps += 1
        outputs = []
        for seq in done:
            self._engine.core.finish_by_length(seq, now)
            c = self._pending.pop(seq, 0)
            outputs.append(EngineCoreOutput(
                seq.request_id, [CompletionDelta(seq.index, [self._token] * c, [0.0] * c, None, seq.cumulative_logprob,
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
