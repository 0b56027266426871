"""Fast-forward: a simulated engine's quiet decode steps at the cost of their events.

Why: most steps of a long simulation are quiet (every running sequence decodes one
token; nobody arrives, finishes, is admitted or preempted: ~74% of a ShareGPT-like
trace's steps at 32 sequences), and each still costs the engine's full per-sequence
Python (scheduling, block table updates, outputs, stats: ~13 us per sequence-step).
What a quiet step changes is known in advance: each sequence gains the simulated token,
its block table gains a block every block_size tokens, the clock advances by the
step-time model. So `DecodeFastForward.advance` applies a run of quiet steps directly,
with work per step O(1) plus one `allocate_slots` call per block that fills or is
added, and hands back to the real `engine.step()` at the first step that is not quiet.

Exactness (tests/experiments/test_fast_forward.py compares every request's times, the
stats and the block tables at every real step against step-by-step runs): each quiet
step's block allocations are made by the real block manager in the real order (step by
step, running order), so block ids, prefix-cache registrations and evictions are the
engine's; a step stops the run before it starts if a request arrives by then, if any
sequence would finish in it, or if its new blocks exceed the free ones (a preemption);
after its allocations, if the scheduler would admit the waiting head
(`Scheduler.would_admit_after_decodes`, its own admission test), the step is left to
the real engine, whose allocations of it are then no-ops. The stats get each step's
figures through `EngineStats.record_decode_step`, tracked incrementally here with
`kv_waste`'s formulas; the front end gets one delta of k tokens per sequence, which its
accumulation makes the same as k deltas of one.

Preconditions (checked; anything else runs step by step): the simulator's own requests
(one greedy completion, ignore_eos, no stop strings or tokens, no logprobs), the paged
block manager, nothing swapped, no forks, every running sequence decoding with its
first token sampled, and nothing finished in the step before (its freed tables would be
reported by the next schedule).
"""

from __future__ import annotations

import time

from paged_jax.core.block_manager import BlockManager
from paged_jax.engine.core_outputs import CompletionDelta, EngineCoreOutput
from paged_jax.worker.batch_inputs import batch_shape


class DecodeFastForward:
    def __init__(self, engine, clock, step_model, token_id: int, buckets=()):
        """`engine`: the simulator's LLMEngine; `clock`: its VirtualClock; `step_model`
        and `buckets` ((seq_buckets, token_buckets) or ()): what its SimulatedRunner
        charges per step; `token_id`: what that runner samples."""
        self._engine, self._clock, self._model = engine, clock, step_model
        self._token, self._buckets = token_id, buckets
        self.num_steps = 0  # quiet steps fast-forwarded so far

    def _quiet(self, running) -> int:
        """How many quiet steps the running sequences allow (0: not all decoding)."""
        core = self._engine.core
        config, sched = core.config, core.scheduler
        n = len(running)
        if (not n or sched.swapped or n > config.max_num_seqs or n > config.max_num_batched_tokens
                or type(core.block_manager) is not BlockManager or core.structured_outputs is not None):
            return 0
        limit = config.max_model_len
        k = None
        for seq in running:
            p = seq.sampling_params
            if p.stop or p.stop_token_ids or not p.ignore_eos or p.logprobs is not None or p.n != 1:
                return 0  # not the simulator's plain requests
            if seq.pending_forks or seq.num_computed_tokens != seq.num_tokens - 1 or seq.first_token_time is None:
                return 0
            # a step appends output token o + 1; the one that reaches max_tokens or max_model_len finishes
            left = min(seq.sampling_params.max_tokens - len(seq.output_token_ids), limit - seq.num_tokens) - 1
            k = left if k is None else min(k, left)
        return max(k, 0)

    def advance(self, next_arrival: float) -> int:
        """Apply quiet steps until one is not (or a request arrives at `next_arrival`);
        returns how many ran. Call only after a step in which nothing finished."""
        start = time.perf_counter()
        core = self._engine.core
        sched, bm, stats = core.scheduler, core.block_manager, core.stats_tracker
        running = list(sched.running)
        k_max = self._quiet(running)
        if k_max <= 0 or next_arrival <= self._clock.now:
            return 0
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
        k, handover = 0, False
        while k < k_max and self._clock.now < next_arrival:
            phase = k % bs
            grown = grows.get(phase, ())
            if len(grown) > bm.num_free_blocks:
                break  # a sequence could not grow: the real step preempts
            for i in events.get(phase, ()):
                seq = running[i]
                if bm.allocate_slots(seq.seq_id, computed[i] + k + 1, tokens=seq.token_ids) != []:
                    raise AssertionError("a quiet step's allocation failed or copied a block")
            if sched.would_admit_after_decodes(n):
                handover = True  # the real step runs it; its allocations are made already
                break
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
            now = self._clock.now
            processed = self._engine.output_processor.process([
                EngineCoreOutput(seq.request_id, [CompletionDelta(seq.index, [self._token] * k, [0.0] * k, None,
                                                                  seq.cumulative_logprob, None)],
                                 False, now, seq.arrival_time, seq.first_token_time, seq.num_cached_tokens)
                for seq in running])
            if processed.request_outputs or processed.stopped:
                raise AssertionError("a quiet step finished a request")
            core.pool_checker.check(core)
            stats.add_host_seconds(time.perf_counter() - start)
            self.num_steps += k
        return k
