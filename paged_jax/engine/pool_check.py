"""The KV pool's self-check in production: a leak is reported loudly, never served on silently.

A block that no table holds but that never went back to the free queue, a sequence left
in the block manager after its request ended, or a request object the engine forgot to
drop: none of them breaks the next answer, all of them shrink the pool (or memory) until
the server refuses work for no visible reason. SGLang checks after every idle step that
free + cached + used blocks equal the pool and kills itself when they do not. paged_jax
checks at the same moments but reports instead of dying: an error log naming what is
wrong, the engine stats' `num_pool_check_failures`, and the server's
`paged_jax:kv_pool_check_failures_total` metric, so an operator sees a leak and decides.

Modes (`EngineConfig.pool_check`):
  * "idle" (the default): whenever a step or an abort leaves the engine with nothing to
    do, only counts: every usable device (and host) block is free (cached blocks with no
    holder sit in the free queue), the allocator holds no sequence, and the engine holds
    no request, sequence or grammar matcher. O(1) plus the sizes of a few dicts.
  * "step": after every step and abort, the block manager's full invariant walk (each
    table has ceil(tokens / block_size) blocks, every ref count equals the number of
    tables holding the block, the free queue is a consistent list; see
    core/block_manager_invariants.py), plus the idle counts whenever idle. For soaks and
    tests: it walks every table.
  * "off": no checks.
"""

from __future__ import annotations

import logging

from paged_jax.core.block_manager_invariants import broken_invariants

logger = logging.getLogger(__name__)


def idle_problems(core) -> list[str]:
    """What an idle engine (`core`: an EngineCore with no unfinished request) still holds."""
    bm, problems = core.block_manager, []
    if bm.num_free_blocks != bm.num_usable_blocks:
        problems.append(f"{bm.num_usable_blocks - bm.num_free_blocks} of {bm.num_usable_blocks} usable device "
                        f"blocks are not free with no request running (leaked blocks)")
    num_host = getattr(bm, "num_host_blocks", 0)
    if bm.num_free_host_blocks != num_host:
        problems.append(f"{num_host - bm.num_free_host_blocks} of {num_host} host blocks are not free "
                        f"with no request running (leaked swap blocks)")
    if bm.num_seqs_held:
        problems.append(f"the block manager still holds {bm.num_seqs_held} sequences' tables")
    for name, held in (("requests", core._requests), ("sequences", core._seqs)):
        if held:
            problems.append(f"the engine still holds {len(held)} {name}: {sorted(held)[:8]}")
    if core.structured_outputs is not None and core.structured_outputs.num_matchers:
        problems.append(f"{core.structured_outputs.num_matchers} grammar matchers outlived their sequences")
    return problems


def walk_problems(core) -> list[str]:
    """Every broken block-manager invariant (a full walk of tables and pools)."""
    bm = core.block_manager
    if hasattr(bm, "_tables"):  # the paged BlockManager
        return broken_invariants(bm)
    try:  # a contiguous baseline: its own check raises
        bm.check_invariants()
    except AssertionError as error:
        return [str(error)]
    return []


class PoolChecker:
    """Runs the configured check after each step and abort; counts and logs failures."""

    def __init__(self, mode: str):
        self.mode = mode
        self.num_checks = 0  # checks run
        self.num_failures = 0  # checks that found a problem
        self.last_problems: list[str] = []  # what the last failing check found

    def check(self, core) -> list[str]:
        """Check `core` now (if the mode says so); returns the problems found (logged and counted)."""
        if self.mode == "off":
            return []
        idle = not core.scheduler.has_unfinished()
        if self.mode == "idle" and not idle:
            return []
        self.num_checks += 1
        problems = walk_problems(core) if self.mode == "step" else []
        if idle:
            problems += idle_problems(core)
        if problems:
            self.num_failures += 1
            self.last_problems = problems
            logger.error("KV pool self-check failed (%s check, failure %d; engine stats: "
                         "num_pool_check_failures):\n  %s", "idle" if idle else "step", self.num_failures,
                         "\n  ".join(problems))
        return problems
