"""The runner's copy of every scheduled sequence's block table, kept between steps.

The scheduler sends table updates, not tables (scheduler_output.py: keep the first
`num_kept_blocks` entries, then `new_block_ids`), so a decode step's batch preparation
copies one fixed-width numpy row per sequence however long the sequence is, instead of
rebuilding and converting every table every step. Rows are dropped when the scheduler
reports a sequence finished (in the next step's output, as vLLM's finished_req_ids) or
preempted (a preempted one comes back with its whole table). numpy only.
"""

from __future__ import annotations

import numpy as np

from paged_jax.core.scheduler_output import ScheduledChunk, SchedulerOutput


class HostBlockTables:
    def __init__(self, width: int):
        self.width = width  # max_blocks_per_seq
        self._rows: dict[int, np.ndarray] = {}  # seq id -> i32[width], padded with the null block 0

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def drop_departed(self, output: SchedulerOutput) -> None:
        """Forget the sequences that finished or were preempted (first, before any update)."""
        for seq_id in output.finished_seq_ids + output.preempted_seq_ids:
            self._rows.pop(seq_id, None)

    def update(self, chunk: ScheduledChunk) -> np.ndarray:
        """Apply a chunk's table update; returns the sequence's row (a view: do not keep)."""
        k, new = chunk.num_kept_blocks, chunk.new_block_ids
        row = self._rows.get(chunk.seq_id)
        if k == 0:
            row = self._rows[chunk.seq_id] = np.zeros(self.width, np.int32)
        elif row is None:
            raise ValueError(f"sequence {chunk.seq_id}: an update keeps {k} blocks of a table this runner never saw")
        if new:
            if k + len(new) > self.width:
                raise ValueError(f"sequence {chunk.seq_id}: {k + len(new)} blocks exceed max_blocks_per_seq "
                                 f"{self.width}")
            row[k:k + len(new)] = new
        return row
