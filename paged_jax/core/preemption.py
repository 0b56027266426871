"""Preemption: which running sequences give up their blocks, and how.

The victim is the last request in `running` (the most recently admitted, or under
priority the lowest-priority, latest-arriving one), preempted whole: by swap (its
blocks copied to host memory as one group, so blocks they share stay shared) or by
recompute (its blocks freed, its sequences requeued at the front of waiting). A request
with several running sequences (beams, n > 1) first makes room for all of them, so it
is never split between running and preempted.

A mixin of Scheduler, which owns the queues (`running`, `waiting`, `swapped`), the
block manager and this step's budget; kept apart so the victim rule reads on one page.
Pure Python.
"""

from __future__ import annotations

import itertools

from paged_jax.core.sequence import Sequence, SequenceStatus


class Preemption:
    def _make_room_for_request(self, i: int, swap_out: list, preempted: list) -> bool:
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
        while not self._request_fits(i):
            victims, orders = self.preempt_last(i)
            swap_out.extend(orders)
            preempted.extend(v.seq_id for v in victims)
            if seq in victims:
                return False
        return True

    def _request_fits(self, i: int) -> bool:
        """Whether the free blocks hold what this step's chunks of running[i]'s request
        (within the budget and rows left) need, copy-on-write of shared last blocks
        included (BlockManager.num_growth_blocks)."""
        bm, request_id = self.block_manager, self.running[i].request_id
        budget, rows, targets = self._budget, self._rows_before + len(self._chunks), {}
        for seq in itertools.takewhile(lambda s: s.request_id == request_id, self.running[i:]):
            num_new = self.num_new_tokens(seq, budget) if budget > 0 and rows < self.config.max_num_seqs else 0
            if num_new:
                targets[seq.seq_id] = max(seq.num_computed_tokens + num_new, bm.num_tokens(seq.seq_id))
                budget -= num_new
                rows += 1
        return bm.num_growth_blocks(targets) <= bm.num_free_blocks

    def preempt_last(self, i: int) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Preempt what schedule() preempts when running[i] cannot grow (`_victims`);
        returns the victims and their swap-out orders (empty for recompute). Public for
        callers that step decodes without schedule() (the simulator's fast-forward)."""
        victims = self._victims(i)
        return victims, self._preempt(victims)

    def _victims(self, i: int) -> list[Sequence]:
        """The last request's running sequences at positions >= i (the trailing run of
        `running`: a request's sequences are adjacent): the most recently admitted one, or
        under priority the lowest-priority, latest-arriving one."""
        request_id = self.running[-1].request_id
        j = len(self.running) - 1
        while j > i and self.running[j - 1].request_id == request_id:
            j -= 1
        return self.running[j:]

    def _preempt(self, victims: list[Sequence]) -> list[tuple[int, int]]:
        """Preempt running sequences as one group; returns swap-out orders (empty for
        recompute)."""
        for seq in victims:
            self.running.remove(seq)
            seq.num_preemptions += 1
        self.num_preemptions += len(victims)
        bm, ids = self.block_manager, [s.seq_id for s in victims]
        if self.config.preemption_mode == "swap" and bm.can_swap_out(ids):
            for seq in victims:
                seq.status = SequenceStatus.SWAPPED
            if self.priority is None:
                self.swapped.append(list(victims))
            else:
                self.priority.insert_group(self.swapped, list(victims))
            return bm.swap_out(ids)
        for seq in reversed(victims):  # recompute (or swap space is full): start over from the tokens
            bm.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            if self.priority is None:
                self.waiting.appendleft(seq)
        if self.priority is not None:  # back into waiting at their request's key, in their order
            for seq in victims:
                self.priority.insert(self.waiting, seq)
        return []
