"""EngineStats' saturated figures on hand-made steps: only steps that left requests
waiting count, and only chunks that sample a token count as output."""

from __future__ import annotations

import types

import pytest

from paged_jax.core.scheduler_output import ScheduledChunk, SchedulerOutput
from paged_jax.engine.stats import EngineStats


class _EmptyPool:
    block_size = 16
    num_usable_blocks = num_free_blocks = 8
    num_blocks_cached = num_evictions = 0

    def num_slots_allocated(self):
        return 0  # no allocation: utilization and waste are not sampled

    def num_blocks_without_sharing(self):
        return 0


def _scheduler():
    return types.SimpleNamespace(waiting=[], swapped=[], running=[], num_preemptions=0, num_swapped=0,
                                 prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0)


def _chunks(*samples):
    return tuple(ScheduledChunk(seq_id=i, token_ids=(1,), start_position=0, num_kept_blocks=0, new_block_ids=(1,),
                                sample=s) for i, s in enumerate(samples))


def test_saturated_throughput_counts_sampled_tokens_of_steps_with_requests_waiting():
    scheduler = _scheduler()
    stats = EngineStats(_EmptyPool(), scheduler, types.SimpleNamespace(num_compilations=0))
    steps = [  # (waiting at schedule, sample flags of the chunks, step seconds)
        (["r9"], (True, True, False), 0.5),  # saturated: 2 tokens in 0.5 s
        (["r9"], (True, False), 0.25),  # saturated: 1 token in 0.25 s
        ([], (True, True, True, True), 1.0),  # the drain: not counted
    ]
    for waiting, samples, seconds in steps:
        scheduler.waiting = waiting
        output = SchedulerOutput(chunks=_chunks(*samples))
        stats.record_schedule(output)
        stats.record_step(output, seconds, seconds / 2)
    figures = stats.as_dict()
    assert figures["num_saturated_steps"] == 2
    assert figures["saturated_mean_batched_seqs"] == pytest.approx(2.5)
    assert figures["saturated_tokens_per_s"] == pytest.approx(3 / 0.75)
    assert figures["mean_batched_seqs"] == pytest.approx(3)


def test_saturated_figures_are_none_when_nothing_waited():
    scheduler = _scheduler()
    stats = EngineStats(_EmptyPool(), scheduler, types.SimpleNamespace(num_compilations=0))
    output = SchedulerOutput(chunks=_chunks(True))
    stats.record_schedule(output)
    stats.record_step(output, 0.1, 0.05)
    figures = stats.as_dict()
    assert figures["saturated_tokens_per_s"] is None and figures["saturated_mean_batched_seqs"] is None
