"""StepPlan: one step's schedule while the scheduler builds it.

Why a separate object: schedule() runs in phases (running sequences, swapped groups,
waiting admissions), each spending what the others left of one token budget and one
row limit. Passing that state to each phase explicitly, instead of keeping it in
scheduler attributes between calls, lets a phase run on its own for a caller that did
the earlier phases itself (the simulator's fast-forward steps its decoding rows without
schedule() and then admits through `Scheduler.admit_waiting`), and lets the preemption
checks read what the step has already taken. Pure Python.
"""

from __future__ import annotations

import dataclasses

from paged_jax.core.scheduler_output import ScheduledChunk


@dataclasses.dataclass
class StepPlan:
    token_budget: int  # tokens the step may still schedule (max_num_batched_tokens minus what it took)
    max_rows: int  # sequences a step may run (max_num_seqs)
    rows_before: int = 0  # rows taken before the phases given this plan ran (by a caller, not in `chunks`)
    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)  # scheduled so far, in row order
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # copy-on-write (src, dst) orders

    def __post_init__(self):
        if self.max_rows < 1 or self.rows_before < 0:
            raise ValueError(f"a step plan needs max_rows >= 1 and rows_before >= 0, got {self.max_rows} and "
                             f"{self.rows_before}")

    @property
    def num_rows(self) -> int:
        return self.rows_before + len(self.chunks)

    def has_room(self) -> bool:
        """Whether another chunk fits: tokens left and a free row."""
        return self.token_budget > 0 and self.num_rows < self.max_rows
