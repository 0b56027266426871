"""Warm-up compiles every program serving needs without running them (model_runner.warm_up):
after it, serving neither traces, lowers, compiles nor reads the compilation cache."""

import jax
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


@pytest.fixture
def compile_events():
    events = []

    def listen(event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            events.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_serving_after_warm_up_compiles_nothing(tiny_llama, compile_events):
    config = EngineConfig(block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                          seq_buckets=(1, 4), token_buckets=(8, 16), enable_prefix_caching=False)
    engine = LLMEngine(tiny_llama, config)
    runner = engine.core.runner
    # warm-up traced every program, or read it whole from the executable cache (executable_cache.py) ...
    assert runner.num_compilations > 0 or runner.executables.hits > 0
    compile_events.clear()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)
    for i, (prompt, params) in enumerate([([3, 4, 5], greedy), ([6] * 14, sampled), ([7, 8], greedy),
                                          ([9] * 5, sampled)]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():  # a 1-row step, mixed 4 x 16 steps, 4-row decodes, greedy and sampled
        engine.step()
    assert engine.stats()["num_compilations_after_warm_up"] == 0
    assert compile_events == []  # ... and serving found every one compiled: nothing traced, lowered or read
