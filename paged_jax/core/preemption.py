"""Preemption: which running sequences give up their blocks, and how.

The victim is the last request in `running` (the most recently admitted, or under
priority the lowest-priority, latest-arriving one), preempted whole: by swap (its
blocks copied to host memory as one group, so blocks they share stay shared) or by
recompute (its blocks freed, its sequences requeued at the front of waiting).

A Preemptor is held by the Scheduler, which owns the queues and passes them in on each
call: the victim rule reads on one page and its only state is its count. (The rule
that a request with several running sequences makes room for all of them first, so it
is never split between running and preempted, is the scheduler's: it is about what a
step schedules.) Pure Python.
"""

from __future__ import annotations

import collections

from paged_jax.core.scheduling_policy import PriorityOrder
from paged_jax.core.sequence import Sequence, SequenceStatus


class Preemptor:
    def __init__(self, block_manager, preemption_mode: str, priority: PriorityOrder | None):
        """`block_manager`: the scheduler's; `preemption_mode`: "swap" or "recompute"
        (EngineConfig); `priority`: the scheduler's PriorityOrder (None: FCFS), which
        places preempted sequences back in their queue."""
        self.block_manager, self.preemption_mode, self.priority = block_manager, preemption_mode, priority
        self.num_preemptions = 0  # sequences preempted (a group counts each member)

    def preempt_last(self, i: int, running: list[Sequence], waiting: collections.deque,
                     swapped: collections.deque) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Preempt the victims of running[i] not being able to grow (`victims`) out of
        `running` into `swapped` or `waiting`; returns them and their swap-out orders
        (empty for recompute)."""
        victims = self.victims(running, i)
        return victims, self._preempt(victims, running, waiting, swapped)

    @staticmethod
    def victims(running: list[Sequence], i: int) -> list[Sequence]:
        """The last request's running sequences at positions >= i (the trailing run of
        `running`: a request's sequences are adjacent): the most recently admitted one, or
        under priority the lowest-priority, latest-arriving one."""
        request_id = running[-1].request_id
        j = len(running) - 1
        while j > i and running[j - 1].request_id == request_id:
            j -= 1
        return running[j:]

    def _preempt(self, victims: list[Sequence], running: list[Sequence], waiting: collections.deque,
                 swapped: collections.deque) -> list[tuple[int, int]]:
        """Preempt running sequences as one group; returns swap-out orders (empty for
        recompute)."""
        for seq in victims:
            running.remove(seq)
            seq.num_preemptions += 1
        self.num_preemptions += len(victims)
        bm, ids = self.block_manager, [s.seq_id for s in victims]
        if self.preemption_mode == "swap" and bm.can_swap_out(ids):
            for seq in victims:
                seq.status = SequenceStatus.SWAPPED
            if self.priority is None:
                swapped.append(list(victims))
            else:
                self.priority.insert_group(swapped, list(victims))
            return bm.swap_out(ids)
        for seq in reversed(victims):  # recompute (or swap space is full): start over from the tokens
            bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            if self.priority is None:
                waiting.appendleft(seq)
        if self.priority is not None:  # back into waiting at their request's key, in their order
            for seq in victims:
                self.priority.insert(waiting, seq)
        return []
