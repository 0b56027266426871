"""Continuous batching at iteration level: which sequences run this step, and how far.

Three queues: waiting (new, or preempted by recompute), running (hold device blocks),
swapped (blocks in host memory). Each step every scheduled sequence's
`num_computed_tokens` catches up towards its `num_tokens` under one token budget
(`max_num_batched_tokens`), so a prefill chunk and decode tokens share a step (vLLM v1's
rule; there is no separate prefill phase). Order of service: running first (in
admission order), then swapped back in, then waiting (FCFS). When the block manager
cannot grow a running sequence, the most recently admitted request's running sequences
(kept adjacent in `running`) are preempted together (a Preemptor, preemption.py), by recompute (free their blocks,
requeue them at the front of waiting) or by swap (copy their blocks to host memory as
one group, so blocks they share stay shared); a request with several running sequences
first makes room for all of them, so it is never split between running and preempted.
A step that preempted admits nothing new.

Priority (`scheduling_policy="priority"`, vLLM's rule; scheduling_policy.py): each queue
is kept in (priority, arrival_time, admission counter) order, lower first, instead of
admission order, so the code above serves the best request first everywhere: waiting
sequences (recompute-preempted ones too) are admitted, swapped groups return and running
sequences get the budget best first, and the tail of `running`, the victim, is the
lowest-priority request, the latest arrival among equals (vLLM v1's victim,
`max(running, key=(priority, arrival_time))`). A victim comes after the sequence that
needs its blocks, so no request is preempted for a lower-priority one. A request's
sequences share its key, so they stay adjacent and are still preempted together.
Swapped groups still return before anything waiting is admitted (progress, below).

Sharing: a new sequence starts from the longest run of cached blocks of its prefix
(prefix caching; only among sequences of equal `cache_salt`), and the completions of an
`n > 1` request are forked from its first sequence once all its prompt tokens but the
last are computed (`pending_forks`). `seq.num_cached_tokens` records the tokens its
first admission found cached (a forked completion inherits its parent's); re-admission
after a recompute preemption leaves it alone.

Progress: whatever the engine admits must finish (tests/core/test_scheduler_progress.py).
So a swapped group is charged exactly the blocks it takes back (`num_growth_blocks`: a
copy-on-write only for a shared partly full last block), and without chunked prefill the
budget must hold a max_model_len prefill.

Each phase spends what the others left of one step's token budget and rows, passed to
it as a StepPlan (step_plan.py), so the admission phase (`admit_waiting`) also runs on its
own after a caller that stepped the running sequences itself (the simulator's fast-forward).

Pure Python; the runner sees only the returned SchedulerOutput.
"""

from __future__ import annotations

import collections
import itertools

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.preemption import Preemptor
from paged_jax.core.scheduler_output import ScheduledChunk, SchedulerOutput
from paged_jax.core.step_plan import StepPlan
from paged_jax.core.scheduling_policy import PriorityOrder
from paged_jax.core.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        limit = config.max_model_len
        if not config.enable_chunked_prefill and limit is not None and config.max_num_batched_tokens < limit:
            # a whole prefill (a prompt, or prompt + output after a recompute preemption)
            # may reach max_model_len tokens; a longer one than the budget would wait forever
            raise ValueError(f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len "
                             f"({config.max_num_batched_tokens} < {limit}): enable chunked prefill, raise "
                             "the budget or lower max_model_len")
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission (or priority) order, a request's sequences adjacent
        self.swapped: collections.deque[list[Sequence]] = collections.deque()  # swap groups
        # "priority": every queue sorted by request key; None: FCFS (admission order)
        self.priority = PriorityOrder() if config.scheduling_policy == "priority" else None
        self.preemptor = Preemptor(block_manager, config.preemption_mode, self.priority)
        self.prefix_cache_query_tokens = 0  # tokens of admitted sequences looked up
        self.prefix_cache_hit_tokens = 0  # of those, tokens found in cached blocks
        self._finished_ids: list[int] = []  # finished since the last schedule(): the runner drops their tables

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.priority is None:
            self.waiting.append(seq)
        else:
            self.priority.join(seq)
            self.priority.insert(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far (a group counts each member)."""
        return self.preemptor.num_preemptions

    @property
    def num_swapped(self) -> int:
        return sum(len(group) for group in self.swapped)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            for group in self.swapped:
                if seq in group:
                    group.remove(seq)
                    if not group:
                        self.swapped.remove(group)
                    break
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)
            self._finished_ids.append(seq.seq_id)
        if self.priority is not None:
            self.priority.leave(seq)
        seq.status = status

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue `child` (a copy of the parent's tokens) right after the parent's request
        members; a running parent shares all its blocks with it (copy-on-write later)."""
        bm = self.block_manager
        if self.priority is not None:
            self.priority.join(child)  # the parent's request: its key, so it queues with its request
        if parent.status is SequenceStatus.RUNNING:
            bm.fork(parent.seq_id, child.seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens  # its prompt's K/V are the parent's
            child.status = SequenceStatus.RUNNING
            i = self.running.index(parent) + 1
            while i < len(self.running) and self.running[i].request_id == parent.request_id:
                i += 1
            self.running.insert(i, child)
        else:  # waiting or swapped: the child computes its tokens from scratch
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            if self.priority is None:
                i = self.waiting.index(parent) + 1 if parent in self.waiting else 0
                self.waiting.insert(i, child)
            else:
                self.priority.insert(self.waiting, child)

    def _fork_if_ready(self, seq: Sequence) -> list[Sequence]:
        """Fork a running sequence's pending completions once it reached its fork point."""
        if not seq.pending_forks or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        children, seq.pending_forks = seq.pending_forks, []
        for child in children:
            self.fork(seq, child)
        return children

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted: list[int] = []
        bm = self.block_manager

        # 1. running sequences, in admission (or priority) order
        i = 0
        while i < len(self.running) and plan.has_room():
            seq = self.running[i]
            if seq.pending_forks:
                self._fork_if_ready(seq)
            if not self._make_room_for_request(i, plan, swap_out, preempted):
                break  # the request was the last one: preempted whole, nothing runs after it
            num_new = self.num_new_tokens(seq, plan.token_budget)
            while num_new and not self._try_schedule(seq, num_new, plan):
                victims, orders = self.preempt_last(i)
                swap_out.extend(orders)
                preempted.extend(v.seq_id for v in victims)
                if seq in victims:
                    break
            i += 1

        # 2. swapped groups come back (whole) before new sequences are admitted
        # after a preemption only if it left nothing scheduled: a step whose one schedulable
        # sequence was preempted (the others awaiting beam candidates) must still move
        may_bring_in = not (preempted and plan.chunks)
        while self.swapped and may_bring_in and plan.has_room():
            group = self.swapped[0]
            ids = [s.seq_id for s in group]
            # exact: a copy-on-write only where a partly full last block is shared, else a
            # group needing the whole free pool (all a lone request may use) never returns
            growth = bm.num_growth_blocks({s.seq_id: max(s.num_tokens_to_compute, s.num_computed_tokens)
                                           for s in group})
            if bm.num_free_blocks - bm.num_swap_in_blocks(ids) - growth < bm.watermark_blocks:
                break
            self.swapped.popleft()
            swap_in.extend(bm.swap_in(ids))
            for seq in group:
                seq.status = SequenceStatus.RUNNING
                self._to_running(seq)
            for seq in group:
                # swapped at its fork point, it has nothing to compute until it forks: fork
                # now, or a step that only swapped it in would schedule nothing (and stall)
                children = self._fork_if_ready(seq)
                for member in [seq] + children:
                    num_new = self.num_new_tokens(member, plan.token_budget)
                    if (num_new and plan.has_room() and not self._try_schedule(member, num_new, plan)
                            and not children):
                        raise AssertionError("checked above: the group and its growth fit")

        # 3. waiting sequences, in queue order (FCFS or priority), while blocks and budget last
        if may_bring_in and not self.swapped:
            self.admit_waiting(plan)

        return SchedulerOutput(tuple(plan.chunks), tuple(plan.copies), tuple(swap_out), tuple(swap_in),
                               tuple(preempted), self.take_finished_ids())

    def admit_waiting(self, plan: StepPlan) -> None:
        """schedule()'s third phase: admit waiting sequences in queue order while `plan`
        has room and the free blocks (watermark kept) hold them, adding their chunks to
        it. schedule() runs it only when nothing is swapped (swapped groups return
        first); so must any other caller."""
        if self.swapped:
            raise ValueError("admission waits while swapped groups wait to come back (schedule()'s order)")
        bm = self.block_manager
        while self.waiting and plan.has_room():
            seq = self.waiting[0]
            admission = self._admission(seq, plan.token_budget)
            if admission is None:
                break
            hits, num_cached, num_new = admission
            final = seq.final_num_tokens
            orders = bm.allocate_slots(seq.seq_id, num_cached + num_new, tokens=seq.token_ids, cached_blocks=hits,
                                       final_num_tokens=final, cache_salt=seq.cache_salt)
            assert orders == [], "a new sequence writes only into fresh blocks"
            self.waiting.popleft()
            self.prefix_cache_query_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += num_cached
            seq.num_computed_tokens = num_cached
            if not seq.num_preemptions:  # first admission: what the request is told was cached
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self._to_running(seq)
            if num_new:
                self._add_chunk(seq, num_new, plan)
            for child in self._fork_if_ready(seq):  # the cache held all but the last token
                if plan.has_room():
                    self._try_schedule(child, self.num_new_tokens(child, plan.token_budget), plan)

    def _admission(self, seq: Sequence, budget: int):
        """(cached blocks, cached tokens, tokens to compute now) if waiting `seq` fits
        `budget` tokens and the free blocks (watermark kept), else None."""
        bm = self.block_manager
        if seq.num_pending:  # preempted with a token in flight: admitted once the engine has read it
            return None
        hits = ([] if seq.skip_reading_prefix_cache
                else bm.find_cached_prefix(seq.token_ids, seq.num_tokens, cache_salt=seq.cache_salt,
                                          memo=seq.prefix_keys))
        num_cached = len(hits) * bm.block_size
        missing = seq.num_tokens_to_compute - num_cached
        num_new = self._fit_budget(missing, budget)
        final = seq.final_num_tokens  # contiguous allocators reserve for it; BlockManager ignores it
        if (missing and not num_new) or not bm.can_allocate(num_cached + num_new, hits, final_num_tokens=final):
            return None
        return hits, num_cached, num_new

    def take_finished_ids(self) -> tuple[int, ...]:
        """The sequences finished since the last call (schedule()'s output names them, so
        the runner drops their tables); public for callers that step without schedule()
        (the simulator's fast-forward, whose runner keeps no tables)."""
        finished, self._finished_ids = tuple(self._finished_ids), []
        return finished

    def num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens schedule()'s first phase gives running `seq` when `budget` tokens of the
        step are left (a decode: 1; a prefill: all missing, or with chunked prefill what
        fits)."""
        if seq.num_pending and self._ends_at_pending(seq):
            return 0  # its pending token is its last (length): nothing to compute for it
        return self._fit_budget(max(seq.num_tokens_to_compute - seq.num_computed_tokens, 0), budget)

    def _ends_at_pending(self, seq: Sequence) -> bool:
        """Whether the length limit ends `seq` at its pending token (async scheduling: the
        engine finishes it once it reads the token; computing the token's K/V would be waste)."""
        return (seq.num_output_tokens >= seq.sampling_params.max_tokens
                or seq.num_tokens >= self.config.max_model_len)

    def _to_running(self, seq: Sequence) -> None:
        if self.priority is None:
            self.running.append(seq)
        else:
            self.priority.insert(self.running, seq)

    def _fit_budget(self, missing: int, budget: int) -> int:
        """All missing tokens if they fit `budget`; else, with chunked prefill, what fits."""
        if missing <= budget:
            return missing
        return budget if self.config.enable_chunked_prefill else 0

    def _try_schedule(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Grow `seq` by `num_new` slots and add its chunk; False (nothing changed) if the
        device lacks blocks."""
        orders = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                                   tokens=seq.token_ids, num_known_tokens=seq.num_known_tokens)
        if orders is None:
            return False
        plan.copies.extend(orders)
        self._add_chunk(seq, num_new, plan)
        return True

    def _add_chunk(self, seq: Sequence, num_new: int, plan: StepPlan) -> None:
        start = seq.num_computed_tokens
        num_kept, new_ids = self.block_manager.table_update(seq.seq_id)
        plan.chunks.append(ScheduledChunk(
            seq_id=seq.seq_id, token_ids=tuple(seq.token_ids(start, start + num_new)), start_position=start,
            num_kept_blocks=num_kept, new_block_ids=new_ids, sample=start + num_new == seq.num_tokens))
        plan.token_budget -= num_new

    # ---- preemption (the victim rule: preemption.py) -----------------------------------
    def preempt_last(self, i: int) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Preempt what schedule() preempts when running[i] cannot grow (the Preemptor's
        victims); returns the victims and their swap-out orders (empty for recompute).
        Public for callers that step decodes without schedule() (the simulator's
        fast-forward)."""
        return self.preemptor.preempt_last(i, self.running, self.waiting, self.swapped)

    def _make_room_for_request(self, i: int, plan: StepPlan, swap_out: list, preempted: list) -> bool:
        """If running[i] leads two or more running sequences of its request (beams, n > 1),
        preempt (schedule()'s victims) until all that this step schedules can grow, so a
        request's sequences grow together or are preempted together, as vLLM schedules a
        sequence group: preempting part of one would leave the rest holding blocks while
        they wait for it (a beam step needs every beam), which can starve the swapped
        part forever. Returns False if the request itself was preempted."""
        running, seq = self.running, self.running[i]
        if (i + 1 == len(running) or running[i + 1].request_id != seq.request_id
                or (i and running[i - 1].request_id == seq.request_id)):
            return True
        while not self._request_fits(i, plan):
            victims, orders = self.preempt_last(i)
            swap_out.extend(orders)
            preempted.extend(v.seq_id for v in victims)
            if seq in victims:
                return False
        return True

    def _request_fits(self, i: int, plan: StepPlan) -> bool:
        """Whether the free blocks hold what this step's chunks of running[i]'s request
        (within the plan's budget and rows left) need, copy-on-write of shared last blocks
        included (BlockManager.num_growth_blocks)."""
        bm, request_id = self.block_manager, self.running[i].request_id
        budget, rows, targets = plan.token_budget, plan.num_rows, {}
        for seq in itertools.takewhile(lambda s: s.request_id == request_id, self.running[i:]):
            num_new = self.num_new_tokens(seq, budget) if budget > 0 and rows < plan.max_rows else 0
            if num_new:
                targets[seq.seq_id] = max(seq.num_computed_tokens + num_new, bm.num_tokens(seq.seq_id))
                budget -= num_new
                rows += 1
        return bm.num_growth_blocks(targets) <= bm.num_free_blocks

    def update(self, output: SchedulerOutput, seqs: dict[int, Sequence]) -> list[tuple[int, Sequence]]:
        """Advance computed counts after a step; returns (row, sequence) for each chunk that
        sampled (the engine appends the token, or hands a beam its candidates)."""
        sampled = []
        for row, chunk in enumerate(output.chunks):
            seq = seqs[chunk.seq_id]
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                sampled.append((row, seq))
        return sampled
