"""SchedulerOutput: the only thing the scheduler hands the runner each step.

Plain Python values, so the host/device border is one explicit data structure: which
sequences run, which tokens of each get their K/V computed, where those live (block
tables), and which block copies and swaps must happen first.

Block tables travel as updates, as vLLM's `new_block_ids`: the runner keeps each
sequence's table from step to step, and a chunk says how many entries to keep and which
ids follow them. A decode step of a long sequence then carries no table at all (a new
block every block_size tokens), so the host work per step does not grow with the
output length. A chunk with `num_kept_blocks == 0` carries its whole table (a sequence
new to the runner, or one whose table was rebuilt by a swap or a recompute).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    seq_id: int
    token_ids: tuple[int, ...]  # tokens [start_position, start_position + n) of the sequence
    start_position: int  # the sequence's num_computed_tokens before this step
    num_kept_blocks: int  # entries of the table the runner holds for this sequence that stay
    new_block_ids: tuple[int, ...]  # the entries after them: the table covers start_position + n tokens
    sample: bool  # the chunk reaches the sequence's last known token: sample the next one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # batch order: running sequences first, then new ones
    block_copies: tuple[tuple[int, int], ...] = ()  # device (src, dst) copy-on-write, before writes
    swap_out: tuple[tuple[int, int], ...] = ()  # (device, host) copies, done before this step
    swap_in: tuple[tuple[int, int], ...] = ()  # (host, device) copies, done before this step
    preempted_seq_ids: tuple[int, ...] = ()  # sequences preempted while scheduling this step
    finished_seq_ids: tuple[int, ...] = ()  # sequences finished (blocks freed) since the last step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
