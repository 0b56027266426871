"""Continuous batching at iteration level: which sequences run this step, and how far.

Three queues, FCFS: waiting (new, or preempted by recompute), running (hold device
blocks), swapped (blocks in host memory). Each step every scheduled sequence's
`num_computed_tokens` catches up towards its `num_tokens` under one token budget
(`max_num_batched_tokens`), so a prefill chunk and decode tokens share a step (vLLM v1's
rule; there is no separate prefill phase). Order of service: running first (in
admission order), then swapped back in, then waiting. When the block manager cannot
grow a running sequence, the most recently admitted running sequence is preempted, by
recompute (free its blocks, requeue it at the front of waiting) or by swap (copy its
blocks to host memory). A step that preempted admits nothing new.

Pure Python; the runner sees only the returned SchedulerOutput.
"""

from __future__ import annotations

import collections

from paged_jax.block_manager import BlockManager
from paged_jax.engine_config import EngineConfig
from paged_jax.scheduler_output import ScheduledChunk, SchedulerOutput
from paged_jax.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.swapped: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        if self.block_manager.has_seq(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        seq.status = status

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted: list[int] = []

        # 1. running sequences, in admission order
        i = 0
        while i < len(self.running) and budget > 0 and len(chunks) < self.config.max_num_seqs:
            seq = self.running[i]
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0:
                i += 1
                continue
            while True:
                orders = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new)
                if orders is not None:
                    copies.extend(orders)
                    chunks.append(self._chunk(seq, num_new))
                    budget -= num_new
                    i += 1
                    break
                victim = self.running[-1]
                swap_out.extend(self._preempt(victim))
                preempted.append(victim.seq_id)
                if victim is seq:
                    break

        # 2. swapped sequences come back before new ones are admitted
        bm = self.block_manager
        while self.swapped and not preempted and budget > 0 and len(chunks) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = self._num_new_tokens(seq, budget)
            blocks_after = bm.num_blocks_needed(seq.num_computed_tokens + num_new)  # swapped-in table + growth
            if num_new == 0 or bm.num_free_blocks - blocks_after < bm.watermark_blocks:
                break
            self.swapped.popleft()
            swap_in.extend(bm.swap_in([seq.seq_id]))
            orders = bm.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new)
            assert orders is not None, "checked above: the swapped-in table and its growth fit"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            copies.extend(orders)
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new

        # 3. waiting sequences, FCFS, while blocks and budget last
        while self.waiting and not preempted and not self.swapped and budget > 0 \
                and len(chunks) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0 or not self.block_manager.can_allocate(num_new):
                break
            orders = self.block_manager.allocate_slots(seq.seq_id, num_new)
            assert orders == [], "a fresh sequence shares no block"
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_new))
            budget -= num_new

        return SchedulerOutput(tuple(chunks), tuple(copies), tuple(swap_out), tuple(swap_in), tuple(preempted))

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: all it lacks, cut to the budget when
        chunked prefill is on; with it off, all or nothing."""
        missing = seq.num_tokens - seq.num_computed_tokens
        if missing <= budget:
            return missing
        return budget if self.config.enable_chunked_prefill else 0

    def _chunk(self, seq: Sequence, num_new: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq_id=seq.seq_id, token_ids=tuple(seq.token_ids(start, start + num_new)),
                              start_position=start, block_table=tuple(self.block_manager.block_table(seq.seq_id)),
                              sample=start + num_new == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> list[tuple[int, int]]:
        """Preempt a running sequence; returns its swap-out orders (empty for recompute)."""
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out([seq.seq_id]):
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return bm.swap_out([seq.seq_id])
        bm.free(seq.seq_id)  # recompute (or swap space is full): start over from the tokens
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return []

    def update(self, output: SchedulerOutput, seqs: dict[int, Sequence], tokens, logprobs) -> list[Sequence]:
        """Advance computed counts after a step and append sampled tokens; returns the
        sequences that got a new token (the engine then checks their stop conditions)."""
        sampled = []
        for chunk, token, logprob in zip(output.chunks, tokens, logprobs):
            seq = seqs[chunk.seq_id]
            seq.num_computed_tokens += chunk.num_tokens
            if chunk.sample:
                seq.output_token_ids.append(int(token))
                seq.output_logprobs.append(float(logprob))
                sampled.append(seq)
        return sampled
