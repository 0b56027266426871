"""Continuous batching at iteration level: which sequences run this step, and how far.

Three queues: waiting (new, or preempted by recompute), running (hold device blocks),
swapped (blocks in host memory). Each step every scheduled sequence's
`num_computed_tokens` catches up towards its `num_tokens` under one token budget
(`max_num_batched_tokens`), so a prefill chunk and decode tokens share a step (vLLM v1's
rule; there is no separate prefill phase). Order of service: running first (in
admission order), then swapped back in, then waiting (FCFS). When the block manager
cannot grow a running sequence, the most recently admitted request's running sequences
(kept adjacent in `running`) are preempted together (preemption.py), by recompute (free their blocks,
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

Pure Python; the runner sees only the returned SchedulerOutput.
"""

from __future__ import annotations

import collections

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.preemption import Preemption
from paged_jax.core.scheduler_output import ScheduledChunk, SchedulerOutput
from paged_jax.core.scheduling_policy import PriorityOrder
from paged_jax.core.sequence import Sequence, SequenceStatus


class Scheduler(Preemption):
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
        self.num_preemptions = 0  # sequences preempted (a group counts each member)
        self.prefix_cache_query_tokens = 0  # tokens of admitted sequences looked up
        self.prefix_cache_hit_tokens = 0  # of those, tokens found in cached blocks
        self._finished_ids: list[int] = []  # finished since the last schedule(): the runner drops their tables
        self._rows_before = 0  # rows a step took before schedule()'s phases ran (admit_after)

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
        self._budget = self.config.max_num_batched_tokens
        self._chunks: list[ScheduledChunk] = []
        self._copies: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted: list[int] = []
        bm = self.block_manager

        # 1. running sequences, in admission (or priority) order
        i = 0
        while i < len(self.running) and self._has_room():
            seq = self.running[i]
            if seq.pending_forks:
                self._fork_if_ready(seq)
            if not self._make_room_for_request(i, swap_out, preempted):
                break  # the request was the last one: preempted whole, nothing runs after it
            num_new = self._num_new_tokens(seq)
            while num_new and not self._try_schedule(seq, num_new):
                victims, orders = self.preempt_last(i)
                swap_out.extend(orders)
                preempted.extend(v.seq_id for v in victims)
                if seq in victims:
                    break
            i += 1

        # 2. swapped groups come back (whole) before new sequences are admitted
        # after a preemption only if it left nothing scheduled: a step whose one schedulable
        # sequence was preempted (the others awaiting beam candidates) must still move
        may_bring_in = not (preempted and self._chunks)
        while self.swapped and may_bring_in and self._has_room():
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
                    num_new = self._num_new_tokens(member)
                    if num_new and self._has_room() and not self._try_schedule(member, num_new) and not children:
                        raise AssertionError("checked above: the group and its growth fit")

        # 3. waiting sequences, in queue order (FCFS or priority), while blocks and budget last
        if may_bring_in and not self.swapped:
            self._admit_waiting()

        return SchedulerOutput(tuple(self._chunks), tuple(self._copies), tuple(swap_out), tuple(swap_in),
                               tuple(preempted), self.take_finished_ids())

    def _admit_waiting(self) -> None:
        bm = self.block_manager
        while self.waiting and self._has_room():
            seq = self.waiting[0]
            plan = self._admission(seq, self._budget)
            if plan is None:
                break
            hits, num_cached, num_new = plan
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
                self._add_chunk(seq, num_new)
            for child in self._fork_if_ready(seq):  # the cache held all but the last token
                if self._has_room():
                    self._try_schedule(child, self._num_new_tokens(child))

    def admit_after(self, num_rows: int, num_tokens: int) -> list[ScheduledChunk]:
        """schedule()'s third phase after the running sequences took `num_rows` rows and
        `num_tokens` tokens (their slots allocated, nothing preempted, nothing swapped):
        admits what it admits and returns their chunks. For callers that step running
        sequences without schedule() (the simulator's fast-forward)."""
        self._budget = self.config.max_num_batched_tokens - num_tokens
        self._chunks, self._copies = [], []
        if self.swapped:
            return []
        self._rows_before = num_rows
        try:
            self._admit_waiting()
        finally:
            self._rows_before = 0
        if self._copies:
            raise AssertionError("an admission copied a block")
        return self._chunks

    def _admission(self, seq: Sequence, budget: int):
        """(cached blocks, cached tokens, tokens to compute now) if waiting `seq` fits
        `budget` tokens and the free blocks (watermark kept), else None."""
        bm = self.block_manager
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
        return self._fit_budget(max(seq.num_tokens_to_compute - seq.num_computed_tokens, 0), budget)

    def _to_running(self, seq: Sequence) -> None:
        if self.priority is None:
            self.running.append(seq)
        else:
            self.priority.insert(self.running, seq)

    def _has_room(self) -> bool:
        return self._budget > 0 and self._rows_before + len(self._chunks) < self.config.max_num_seqs

    def _fit_budget(self, missing: int, budget: int | None = None) -> int:
        """All missing tokens if they fit the budget (default: this step's left); else,
        with chunked prefill, what fits."""
        budget = self._budget if budget is None else budget
        if missing <= budget:
            return missing
        return budget if self.config.enable_chunked_prefill else 0

    def _num_new_tokens(self, seq: Sequence) -> int:
        return self.num_new_tokens(seq, self._budget)

    def _try_schedule(self, seq: Sequence, num_new: int) -> bool:
        """Grow `seq` by `num_new` slots and add its chunk; False (nothing changed) if the
        device lacks blocks."""
        orders = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new,
                                                   tokens=seq.token_ids)
        if orders is None:
            return False
        self._copies.extend(orders)
        self._add_chunk(seq, num_new)
        return True

    def _add_chunk(self, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        num_kept, new_ids = self.block_manager.table_update(seq.seq_id)
        self._chunks.append(ScheduledChunk(
            seq_id=seq.seq_id, token_ids=tuple(seq.token_ids(start, start + num_new)), start_position=start,
            num_kept_blocks=num_kept, new_block_ids=new_ids, sample=start + num_new == seq.num_tokens))
        self._budget -= num_new

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
