"""Fast-forward: a simulated engine's steps at the cost of their events, not their rows.

Why: a long simulation runs millions of steps, and each `engine.step()` costs the
engine's full per-sequence Python (scheduling, block table updates, per-row outputs,
stats: ~20 us per sequence-step on a slow core) although with the simulator's runner
most of what a step changes is known in advance. `FastForward.advance` applies
steps until one may finish a request (or a request arrives), in four ways:

- quiet runs (every running sequence decodes one token; nobody is admitted, preempted or
  finished): O(1) per step plus one `allocate_slots` call per block that fills or is
  added, the stats' figures tracked incrementally with `kv_waste`'s formulas;
- a chunked prefill's continuation (the last running sequence prefills while the others
  decode): O(rows) per step, the chunk the budget leaves as schedule() computes it
  (`Scheduler.num_new_tokens`);
- decode steps that preempt: in running order each sequence grows, and where the blocks
  run out the scheduler's own choice is preempted (`Scheduler.preempt_last`);
- any other step that cannot finish a request (admissions, swaps, several prefills):
  the real `schedule()`, stats and sequence updates, without the runner and per-row
  outputs (`_lean_step`).

Exactness (tests/experiments/test_fast_forward.py compares every request's times, the
stats and the block tables at every schedule() call against step-by-step runs): block
allocations are made by the real block manager in the real order (step by step,
running order), so block ids, prefix-cache registrations and evictions are the
engine's; a directly applied step stops the run before it starts if a request arrives
by then or a sequence would finish in it; after its allocations, if the scheduler
would admit the waiting head (`Scheduler.would_admit_after`, its own admission test),
the step goes through schedule(), whose allocations of it are then no-ops. The KV
figures of steps with O(rows) work come from the stats' own `record_schedule`; the
sequences finished by the last real step are taken off the scheduler
(`take_finished_ids`) by the first step applied without schedule(), as that step's
schedule() would report them to a runner (the simulator's keeps no tables). The front
end gets, per sequence, one delta of all the tokens it sampled in the run, which its
accumulation makes the same as one delta per step; a step that may finish a request
(a sequence that is scheduled could reach max_tokens or max_model_len) is left to the
real `engine.step()`.

Preconditions (checked; anything else runs step by step): the simulator's own requests
(one greedy completion, ignore_eos, no stop strings or tokens, no logprobs), the paged
block manager, no structured outputs; the directly applied steps also need nothing
swapped, no forks and every decoding sequence's first token sampled.
"""

from __future__ import annotations

import itertools
import time

from paged_jax.core.block_manager import BlockManager
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
        self.num_steps = 0  # steps applied without schedule() so far (quiet, continuation, preempting)
        self.num_prefill_steps = 0  # of those, steps that continued a chunked prefill
        self.num_preempting_steps = 0  # of those, decode steps that preempted (recompute or swap)
        self.num_lean_steps = 0  # steps run through the real schedule() without engine.step()
        self.num_runs = 0  # advance() calls that fast-forwarded at least one step
        # why each advance() call stopped (experiments/profile_simulator.py reports it):
        # the last direct run's end, arrival, finish (a sequence's last token is next),
        # not_quiet, preempt or admit, where the lean step that followed could not run
        self.run_ends: dict[str, int] = {}

    def _eligible(self, running) -> bool:
        """The engine-wide preconditions (module docstring) and the simulator's plain
        requests (one greedy completion, ignore_eos, no stops or logprobs, no forks)."""
        core = self._engine.core
        config = core.config
        n = len(running)
        if (not n or core.scheduler.swapped or n > config.max_num_seqs or n > config.max_num_batched_tokens
                or type(core.block_manager) is not BlockManager or core.structured_outputs is not None):
            return False
        for seq in running:
            p = seq.sampling_params
            if (p.stop or p.stop_token_ids or not p.ignore_eos or p.logprobs is not None or p.n != 1
                    or p.prompt_logprobs is not None or seq.pending_forks):
                return False
        return True

    @staticmethod
    def _decoding(seq) -> bool:
        return seq.num_computed_tokens == seq.num_tokens - 1 and seq.first_token_time is not None

    def _steps_left(self, seq) -> int:
        """Steps a decoding `seq` runs before the one that finishes it (a step appends
        output token o + 1; the one that reaches max_tokens or max_model_len finishes)."""
        limit = self._engine.core.config.max_model_len
        return min(seq.sampling_params.max_tokens - len(seq.output_token_ids), limit - seq.num_tokens) - 1

    def _quiet(self, running) -> int:
        """How many quiet steps the running sequences allow (0: not all decoding)."""
        if not self._eligible(running) or not all(self._decoding(seq) for seq in running):
            return 0
        return max(min(self._steps_left(seq) for seq in running), 0)

    def advance(self, next_arrival: float) -> int:
        """Apply steps until one may finish a request or a request arrives at
        `next_arrival`: quiet runs (and a chunked prefill's continuation) directly, other
        steps through the real scheduler (`_lean_step`); returns how many ran."""
        start = time.perf_counter()
        core = self._engine.core
        sched = core.scheduler
        self._pending: dict = {}  # sequence -> tokens sampled in these steps, reported at the end
        k, end = 0, "arrival"
        while self._clock.now < next_arrival:
            running = list(sched.running)
            end = "not_quiet"
            if self._eligible(running) and not sched.swapped:
                if not self._decoding(running[-1]) and all(self._decoding(seq) for seq in running[:-1]):
                    run, end = self._continue_prefill(running, next_arrival)
                    k += run
                    self.num_steps += run
                    self.num_prefill_steps += run
                if end is None or end == "not_quiet":
                    run, end = self._decode_run(running, next_arrival)
                    k += run
                    self.num_steps += run
                if end == "preempt" and all(self._decoding(seq) for seq in running):
                    self._preempting_step()
                    k += 1
                    self.num_steps += 1
                    self.num_preempting_steps += 1
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
        return k

    def _could_finish(self, seq) -> bool:
        """Whether `seq` may finish in the next step if scheduled (its next token reaches
        max_tokens or max_model_len), or is not one of the simulator's plain requests."""
        p = seq.sampling_params
        if (p.stop or p.stop_token_ids or not p.ignore_eos or p.logprobs is not None or p.n != 1
                or p.prompt_logprobs is not None or seq.pending_forks):
            return True
        return self._steps_left(seq) <= 0

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

    def _preempting_step(self) -> None:
        """A step of decodes in which some sequence cannot grow, as schedule()'s first
        phase runs it: in running order each grows by a slot, and where the blocks run
        out the scheduler preempts its choice (Scheduler.preempt_last) until it fits or
        is itself preempted; nothing is admitted after a preemption that left rows. The caller checked
        that every running sequence decodes and none finishes."""
        core = self._engine.core
        sched, bm, stats = core.scheduler, core.block_manager, core.stats_tracker
        sched.take_finished_ids()
        rows, running, i = [], sched.running, 0
        while i < len(running):
            seq = running[i]
            orders = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + 1, tokens=seq.token_ids)
            while orders is None:
                victims, _ = sched.preempt_last(i)
                if seq in victims:
                    break
                orders = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + 1, tokens=seq.token_ids)
            if orders is None:
                break
            if orders:
                raise AssertionError("a decode's allocation copied a block")
            rows.append(seq)
            i += 1
        if not rows:  # schedule() would go on to admit: a lone decode always fits its pool
            raise AssertionError("a preempting step preempted every running sequence")
        for seq in rows:
            bm.table_update(seq.seq_id)
        n = len(rows)
        stats.record_schedule(None)
        stats.record_step_shape(n, n, n)
        num_seqs, num_tokens = batch_shape(*self._buckets, n, n) if self._buckets else (n, n)
        self._clock.now += self._model.seconds(num_tokens, num_seqs, sum(seq.num_computed_tokens for seq in rows) + n)
        for seq in rows:
            seq.num_computed_tokens += 1
            seq.output_token_ids.append(self._token)
            self._pending[seq] = self._pending.get(seq, 0) + 1

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

    def _continue_prefill(self, running, next_arrival: float) -> tuple[int, str | None]:
        """Steps in which the last running sequence continues a chunked prefill while the
        others decode, each as schedule() makes it: the decodes first, then the chunk the
        budget leaves (Scheduler.num_new_tokens), allocations in that order, the KV
        figures sampled by the stats' own record_schedule; O(rows) per step, without
        SchedulerOutput, runner or per-row outputs. Returns (steps, why it stopped; None
        once the prefill sampled its token, after which every sequence decodes)."""
        core = self._engine.core
        sched, bm, stats = core.scheduler, core.block_manager, core.stats_tracker
        *decoders, p = running
        n, bs, limit = len(running), bm.block_size, core.config.max_model_len
        budget = core.config.max_num_batched_tokens - len(decoders)
        k_max = min((self._steps_left(seq) for seq in decoders), default=1 << 62)
        counts = [0] * n
        k, end = 0, None
        while True:
            if self._clock.now >= next_arrival:
                end = "arrival"
                break
            chunk = sched.num_new_tokens(p, budget) if budget > 0 else 0
            if not chunk:
                end = "not_quiet"  # the chunk does not fit: whatever schedule() does is left to it
                break
            sample = p.num_computed_tokens + chunk == p.num_tokens
            if k >= k_max or (sample and (len(p.output_token_ids) + 1 >= p.sampling_params.max_tokens
                                          or p.num_tokens + 1 >= limit)):
                end = "finish"
                break
            grown = [seq for seq in decoders if seq.num_computed_tokens % bs == 0]
            p_blocks = bm.num_blocks_needed(p.num_computed_tokens + chunk) - bm.num_blocks_needed(p.num_computed_tokens)
            if len(grown) + p_blocks > bm.num_free_blocks:
                end = "preempt"
                break
            for seq in decoders:
                if bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + 1, tokens=seq.token_ids) != []:
                    raise AssertionError("a decode's allocation failed or copied a block")
            if bm.allocate_slots(p.seq_id, p.num_computed_tokens + chunk, tokens=p.token_ids) != []:
                raise AssertionError("a prefill chunk's allocation failed or copied a block")
            if sched.would_admit_after(n, len(decoders) + chunk):
                end = "admit"  # the real step runs it; its allocations are made already
                break
            sched.take_finished_ids()
            for seq in grown:
                bm.table_update(seq.seq_id)
            if p_blocks:
                bm.table_update(p.seq_id)
            stats.record_schedule(None)
            stats.record_step_shape(n, len(decoders) + chunk, len(decoders) + sample)
            num_tokens, num_seqs = len(decoders) + chunk, n
            if self._buckets:
                num_seqs, num_tokens = batch_shape(*self._buckets, num_seqs, num_tokens)
            context = sum(seq.num_computed_tokens for seq in decoders) + len(decoders) + p.num_computed_tokens + chunk
            self._clock.now += self._model.seconds(num_tokens, num_seqs, context)
            for seq in decoders:
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(self._token)
            for i in range(n - 1):
                counts[i] += 1
            p.num_computed_tokens += chunk
            k += 1
            if sample:
                p.output_token_ids.append(self._token)
                counts[-1] += 1
                core.record_first_token(p, self._clock.now)
                break
        for seq, c in zip(running, counts):
            if c:
                self._pending[seq] = self._pending.get(seq, 0) + c
        return k, end

    def _decode_run(self, running, next_arrival: float) -> tuple[int, str]:
        """Quiet steps (every running sequence decodes), O(1) per step plus one
        allocate_slots per block that fills or is added (module docstring); returns
        (steps, why the run stopped)."""
        core = self._engine.core
        sched, bm, stats = core.scheduler, core.block_manager, core.stats_tracker
        k_max = self._quiet(running)
        if k_max <= 0 or next_arrival <= self._clock.now:
            return 0, ("not_quiet" if k_max <= 0 else "arrival")
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

    def _ended(self, reason: str) -> None:
        self.run_ends[reason] = self.run_ends.get(reason, 0) + 1
