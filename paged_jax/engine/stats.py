"""Running figures of an engine: KV utilization, preemptions, compilations, step times.

Two tiers. The cheap figures (counts, batch sizes, step times, blocks used) cost O(1)
per step and are always kept. The paper's figures below each cost a Python pass over the
sequences every step (three passes: tokens held, waste, blocks without sharing), so they
are kept only when asked for, `EngineConfig(paper_metrics=True)`: the experiments that
record them set it; a server or a notebook's `LLM` does not pay for them (their keys are
None then). The dashboard's pool snapshot (pool_snapshot.py) computes its own figures
when it is taken, not per step.

KV utilization is tokens held / token slots allocated on the device, sampled after each
step's allocation and averaged over steps (the paper's measure of memory waste: with
paging only each sequence's last block is partly empty).

The waste behind it is split the same way, in token slots per step (core/kv_waste.py,
which the allocator may answer itself): internal (reserved slots never to be used), reservation
(reserved for the request's later tokens, not yet used) and external (free slots in gaps
too short for the head of the waiting queue; 0 for paged blocks), the paper's Fig. 2.

Sharing is measured the same way: each step, the blocks the device-resident block tables
would need if nothing were shared (parallel samples, beams, prefix-cache hits) against
the distinct blocks they hold; `sharing_savings` = 1 - held / needed-without-sharing,
summed over steps (the paper's "memory saving" of Fig. 15 and 16).
"""

from __future__ import annotations

import collections

from paged_jax.core.kv_waste import kv_waste

STEP_LOG_LENGTH = 10_000  # recent steps kept for per-step analysis


class EngineStats:
    def __init__(self, block_manager, scheduler, runner, *, paper_metrics: bool = False):
        """`paper_metrics`: keep the paper's per-step figures (module docstring)."""
        self._bm, self._scheduler, self._runner = block_manager, scheduler, runner
        self.paper_metrics = paper_metrics
        self.num_steps = 0
        self._utilization_sum = 0.0
        self._utilization_steps = 0
        # waste in token slots summed over the same steps (core/kv_waste.py)
        self._waste_sums = {"internal": 0, "reservation": 0, "external": 0}
        self._blocks_without_sharing_sum = 0  # summed over steps
        self._blocks_used_sum = 0
        self.host_seconds = 0.0  # scheduling, batch preparation, output processing
        self.device_seconds = 0.0  # inside the jitted step and swaps
        self.num_batched_tokens = 0
        self.num_batched_seqs = 0
        self.max_batched_seqs = 0
        # steps that ran while requests still waited: their batch is what the KV budget
        # (or max_num_seqs) admits, the paper's "batched requests" at saturation
        self._waiting_at_schedule = False
        self.num_saturated_steps = 0
        self.saturated_batched_seqs = 0
        # and what those steps produced in their wall time: the throughput the budget
        # sustains under load (the paper's sustained rate), without the end-of-trace drain
        self.saturated_seconds = 0.0
        self.saturated_sampled_tokens = 0
        self.num_imported_blocks = 0  # prompt K/V blocks adopted from another engine (kv_transfer.py)
        self._compilations_at_warm_up = runner.num_compilations
        # (num_seqs, num_tokens, host_seconds, device_seconds) of recent steps
        self.step_log: collections.deque = collections.deque(maxlen=STEP_LOG_LENGTH)

    def record_schedule(self, output) -> None:
        """A step's KV figures, sampled after its allocation: O(1), plus the paper's
        figures' passes over the sequences when they are kept."""
        bm, slots = self._bm, self._bm.num_slots_allocated()
        if self.paper_metrics:
            waste = None
            if slots:
                waiting = self._scheduler.waiting
                waste = kv_waste(bm, self._scheduler.running, waiting[0] if waiting else None)
            self.add_paper_figures(slots, bm.num_tokens_held() if slots else 0, waste,
                                   bm.num_blocks_without_sharing())
        self.add_allocation(slots)

    def add_allocation(self, slots: int) -> None:
        """The cheap part of a step's KV figures: `slots` token slots allocated after its
        allocation (blocks used), and whether requests still waited then."""
        self._blocks_used_sum += slots // self._bm.block_size
        self._waiting_at_schedule = bool(self._scheduler.waiting or self._scheduler.swapped)

    def add_paper_figures(self, slots: int, held: int, waste: dict | None, blocks_without_sharing: int) -> None:
        """The paper's figures of one step, sampled after its allocation: `slots`
        allocated, `held` tokens in them, `waste` (kv_waste's dict; None when nothing is
        allocated), and the blocks its tables would need without sharing. Public for a
        caller that tracks them itself (the simulator's fast-forward); a no-op unless
        paper_metrics is on."""
        if not self.paper_metrics:
            return
        if slots:
            self._utilization_sum += held / slots
            self._utilization_steps += 1
            for kind, slots_wasted in waste.items():
                self._waste_sums[kind] += slots_wasted
        self._blocks_without_sharing_sum += blocks_without_sharing

    def record_step(self, output, step_seconds: float, device_seconds: float) -> None:
        self.add_step(len(output.chunks), output.num_batched_tokens, sum(chunk.sample for chunk in output.chunks),
                      step_seconds, device_seconds)

    def add_step(self, num_seqs: int, num_tokens: int, num_sampled: int, step_seconds: float,
                 device_seconds: float) -> None:
        """A step's shape (rows, tokens, tokens sampled) and times, after record_schedule
        or add_allocation recorded its KV figures."""
        self.num_steps += 1
        self.device_seconds += device_seconds
        self.host_seconds += step_seconds - device_seconds
        self.num_batched_tokens += num_tokens
        self.num_batched_seqs += num_seqs
        self.max_batched_seqs = max(self.max_batched_seqs, num_seqs)
        if self._waiting_at_schedule:
            self.num_saturated_steps += 1
            self.saturated_batched_seqs += num_seqs
            self.saturated_seconds += step_seconds
            self.saturated_sampled_tokens += num_sampled
        self.step_log.append((num_seqs, num_tokens, step_seconds - device_seconds, device_seconds))

    def add_host_seconds(self, seconds: float) -> None:
        """Host work of the last recorded step done after it returned (the front end
        turning its tokens into outputs): counted as that step's host time."""
        self.host_seconds += seconds
        if self._waiting_at_schedule:
            self.saturated_seconds += seconds
        if self.step_log:
            num_seqs, num_tokens, host, device = self.step_log[-1]
            self.step_log[-1] = (num_seqs, num_tokens, host + seconds, device)

    def as_dict(self) -> dict:
        bm, steps = self._bm, max(self.num_steps, 1)
        paper = self.paper_metrics  # else the paper's figures are None (not kept: module docstring)
        return {
            "num_blocks_total": bm.num_usable_blocks,
            "num_blocks_free": bm.num_free_blocks,
            "block_size": bm.block_size,
            "kv_utilization": self._utilization_sum / self._utilization_steps if self._utilization_steps else None,
            # token slots per step, over the steps kv_utilization averages (core/kv_waste.py): reserved
            # never to be used / reserved for later tokens / free in gaps too short for the next waiting request
            **{f"waste_{kind}_slots": total / self._utilization_steps if self._utilization_steps else None
               for kind, total in self._waste_sums.items()},
            "num_preemptions": self._scheduler.num_preemptions,
            "num_compilations": self._runner.num_compilations,
            "num_compilations_after_warm_up": self._runner.num_compilations - self._compilations_at_warm_up,
            "num_steps": self.num_steps,
            "num_running": len(self._scheduler.running),
            "num_waiting": len(self._scheduler.waiting),
            "num_swapped": self._scheduler.num_swapped,
            "prefix_cache_query_tokens": self._scheduler.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": self._scheduler.prefix_cache_hit_tokens,
            "num_blocks_cached": bm.num_blocks_cached,
            "num_prefix_cache_evictions": bm.num_evictions,
            "num_imported_blocks": self.num_imported_blocks,
            "num_blocks_used": bm.num_slots_allocated() // bm.block_size,
            # the server reads stats() after every step: this one walks the tables, so it is a paper figure
            "num_blocks_without_sharing": bm.num_blocks_without_sharing() if paper else None,
            "mean_blocks_used": self._blocks_used_sum / steps,
            "mean_blocks_without_sharing": self._blocks_without_sharing_sum / steps if paper else None,
            "sharing_savings": ((1 - self._blocks_used_sum / self._blocks_without_sharing_sum
                                 if self._blocks_without_sharing_sum else 0.0) if paper else None),
            "mean_batched_seqs": self.num_batched_seqs / steps,
            "max_batched_seqs": self.max_batched_seqs,
            # over the steps that left requests waiting (None if none did)
            "saturated_mean_batched_seqs": (self.saturated_batched_seqs / self.num_saturated_steps
                                            if self.num_saturated_steps else None),
            "num_saturated_steps": self.num_saturated_steps,
            # tokens sampled per second of wall time over those steps (None if none waited)
            "saturated_tokens_per_s": (self.saturated_sampled_tokens / self.saturated_seconds
                                       if self.saturated_seconds else None),
            "mean_batched_tokens": self.num_batched_tokens / steps,
            "host_seconds_per_step": self.host_seconds / steps,
            "device_seconds_per_step": self.device_seconds / steps,
            "host_fraction": self.host_seconds / max(self.host_seconds + self.device_seconds, 1e-12),
        }
