"""experiments/engine_overhead.py's phase timer (experiments/benchmarks/phase_timer.py): the phases add up
to the step, and it sees what it should."""

import dataclasses

import pytest

from experiments.benchmarks.host_only_runner import HostOnlyRunner
from experiments.benchmarks.phase_timer import PHASES, PhaseTimer, decode_steps, summarize
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.worker.model_runner import ModelRunner

N = 4
CONFIG = EngineConfig(max_model_len=64, max_num_seqs=N, max_num_batched_tokens=32, block_size=8, num_blocks=40,
                      seq_buckets=(N,), token_buckets=(N, 32), enable_prefix_caching=False)


@pytest.mark.parametrize("factory", [ModelRunner, HostOnlyRunner], ids=["model", "host_only"])
def test_phases_add_up_to_the_step(tiny_llama, factory):
    engine = LLMEngine(tiny_llama, CONFIG, runner_factory=factory, final_outputs_only=True)
    timer = PhaseTimer(engine)
    prompts = [[5 + i, 6, 7, 8] for i in range(N)]
    steps = decode_steps(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), timer)
    assert len(steps) == 5  # 6 tokens: the first comes with the prefill step, 5 decode every sequence
    for step in steps:
        parts = sum(step[p] for p in PHASES)
        assert parts == pytest.approx(step["wall"], rel=1e-6, abs=1e-7)
        assert all(step[p] >= 0 for p in PHASES if p != "core_update") and step["schedule"] > 0
    summary = summarize(steps)
    assert set(summary["phases_ms"]) == set(PHASES) and summary["decode_steps"] == 5
    if factory is HostOnlyRunner:  # no device: the device is idle the whole step
        assert summary["phases_ms"]["device"] == 0 and summary["device_idle_fraction"] == 1
    else:
        assert summary["phases_ms"]["device"] > 0 and 0 < summary["device_idle_fraction"] < 1


def test_paper_figures_are_computed_only_with_the_switch(tiny_llama):
    """The paper's per-sequence passes (here: blocks without sharing) run only with the switch."""
    calls = {}
    for paper in (False, True):
        engine = LLMEngine(tiny_llama, dataclasses.replace(CONFIG, paper_metrics=paper), runner_factory=HostOnlyRunner,
                           final_outputs_only=True)
        bm = engine.core.block_manager
        counted = {"n": 0}
        inner = bm.num_blocks_without_sharing

        def counting(*args, _inner=inner, _counted=counted, **kwargs):
            _counted["n"] += 1
            return _inner(*args, **kwargs)
        bm.num_blocks_without_sharing = counting
        timer = PhaseTimer(engine)
        decode_steps(engine, [[5, 6, 7, 8]] * N, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), timer)
        calls[paper] = counted["n"]
    assert calls[False] == 0 < calls[True]
