"""The server's `priority` field (vLLM's extension) reaches the engine's scheduler: a
priority server passes each request's priority with every prompt of it; a fcfs server
refuses a non-zero one (tests/entrypoints/test_server_errors.py). The scheduling rule
itself is tests/core/test_priority_scheduling.py's."""

import httpx

from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer


def test_priority_reaches_the_core(tiny_llama, monkeypatch):
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=8, num_blocks=32, max_model_len=64, max_num_seqs=4,
                                                max_num_batched_tokens=16, seq_buckets=(4,), token_buckets=(16,),
                                                scheduling_policy="priority"))
    seen = {}
    add = engine.core.add_request

    def spy(request_id, prompt_token_ids, params=None, **kwargs):
        seen[request_id] = kwargs.get("priority")
        return add(request_id, prompt_token_ids, params, **kwargs)

    monkeypatch.setattr(engine.core, "add_request", spy)
    server = BackgroundServer(build_app(engine, ServerSettings(served_model_name="tiny")))
    try:
        for priority in (3, -1):
            r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "priority": priority})
            assert r.status_code == 200, r.text
            assert sorted(v for k, v in seen.items()) == [priority, priority]
            seen.clear()
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200 and list(seen.values()) == [0]  # the default
    finally:
        server.stop()
