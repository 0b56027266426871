"""EngineStats on hand-made steps: the saturated figures count only steps that left
requests waiting, and only chunks that sample a token count as output; the paper's
figures (a pass over the sequences per step) are kept only with paper_metrics on."""

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


# ---- the paper's figures cost a pass over the sequences per step: kept only when asked for


class _CountingPool:
    """A real BlockManager that counts the per-sequence queries made of it (the passes
    the paper's figures make: tokens held, per-sequence waste, blocks without sharing)."""

    PER_SEQUENCE = ("num_tokens_held", "num_blocks_without_sharing", "num_tokens", "has_seq")

    def __init__(self, bm):
        self._bm = bm
        self.calls = 0

    def __getattr__(self, name):
        if name in self.PER_SEQUENCE:
            self.calls += 1
        return getattr(self._bm, name)


def _decoding_state(num_seqs: int = 64):
    """A scheduler with `num_seqs` sequences past their prefill, and its next (decode) step."""
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.core.block_manager import BlockManager
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.core.scheduler import Scheduler
    from paged_jax.core.sequence import Sequence
    config = EngineConfig(block_size=4, num_blocks=1024, max_model_len=64, max_num_seqs=num_seqs,
                          max_num_batched_tokens=8 * num_seqs)
    bm = BlockManager(config.num_blocks, config.block_size)
    scheduler = Scheduler(config, bm)
    seqs = {}
    for i in range(num_seqs):
        seq = Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_token_ids=[3 + i % 7] * 6,
                       sampling_params=SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.0, seed=0)
        seqs[i] = seq
        scheduler.add(seq)
    for _ in range(2):  # the prefill, then one decode (each sampling a token)
        for _, seq in scheduler.update(scheduler.schedule(), seqs):
            seq.output_token_ids.append(5)
    return bm, scheduler, scheduler.schedule()


@pytest.mark.parametrize("paper_metrics", [False, True])
def test_the_paper_figures_pass_over_the_sequences_only_when_asked_for(paper_metrics):
    bm, scheduler, output = _decoding_state()
    assert len(output.chunks) == 64
    pool = _CountingPool(bm)
    stats = EngineStats(pool, scheduler, types.SimpleNamespace(num_compilations=0), paper_metrics=paper_metrics)
    stats.record_schedule(output)
    stats.record_step(output, 0.01, 0.005)
    figures = stats.as_dict()
    if paper_metrics:
        assert pool.calls > 0
        assert 0 < figures["kv_utilization"] <= 1 and figures["mean_blocks_without_sharing"] > 0
        assert figures["waste_external_slots"] == 0  # paged
    else:  # default: O(1) per step; the paper's keys are there, as None
        assert pool.calls == 0
        assert figures["kv_utilization"] is None and figures["sharing_savings"] is None
        assert figures["waste_internal_slots"] is None and figures["mean_blocks_without_sharing"] is None
    # the cheap figures are kept either way
    assert figures["mean_blocks_used"] == bm.num_slots_allocated() // bm.block_size > 0
    assert figures["mean_batched_seqs"] == 64


def test_the_engine_config_switch_is_a_bool_and_off_by_default():
    from paged_jax.config.engine_config import EngineConfig
    assert EngineConfig().paper_metrics is False
    with pytest.raises(ValueError, match="paper_metrics"):
        EngineConfig(paper_metrics="yes")
