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


def test_results_row_shows_host_time_off_and_on():
    from experiments.reporting import results_rows
    from tests.helpers.row_numbers import shows_in_order

    def row(runner, paper, host, stats, idle):
        return {"runner": runner, "paper_metrics": paper, "host_ms": host, "device_idle_fraction": idle,
                "phases_ms": {"stats": stats}}
    record = {"environment": {"platform": "cpu", "cpu_count": 2},
              "figures": {"model": "tiny", "num_seqs": 64,
                          "rows": [row("model", False, 0.9, 0.016, 0.25), row("model", True, 1.1, 0.064, 0.2),
                                   row("host_only", False, 0.6, 0.009, 1.0), row("host_only", True, 0.7, 0.048, 1.0)]}}
    (model_label, model_value), (host_label, host_value) = results_rows.BUILDERS["engine_overhead"](record)
    assert shows_in_order(model_value, "0.900", "1.100", "0.016", "0.064", "25.0")
    assert shows_in_order(host_value, "0.600", "0.700", "0.009", "0.048") and "idle" not in host_value
    assert "64" in model_label and "64" in host_label
