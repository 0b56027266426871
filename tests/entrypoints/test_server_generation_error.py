"""A completion that fails inside the engine (finish reason "error": its grammar matcher
failed) reaches the client as an error, never as a finished answer: a 500 in OpenAI's
shape (code "generation_error", as vLLM answers it), and in a stream the same body as
the last event before [DONE], on both generation routes.

The matchers are forced into their error state as in tests/engine/test_structured_outputs.py:
each step's mask is computed but not applied, so the tiny random model (SmolLM2's real
tokenizer) samples tokens the choice refuses."""

import json

import httpx
import numpy as np
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.grammar_matchers import StructuredOutputManager
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
from paged_jax.loading import load_model
from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab

CHOICE = {"choice": ["red", "green", "blue"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_smollm2_vocab"))
    save_tiny_smollm2_vocab(path)
    compute = StructuredOutputManager.bitmask

    def computed_but_not_applied(self, chunks, seqs):
        mask = compute(self, chunks, seqs)
        return None if mask is None else np.full_like(mask, -1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StructuredOutputManager, "bitmask", computed_but_not_applied)
        engine = LLMEngine(load_model(path), EngineConfig(block_size=8, num_blocks=64, max_model_len=128,
                                                          max_num_seqs=4, max_num_batched_tokens=32,
                                                          seq_buckets=(4,), token_buckets=(8, 32)))
        server = BackgroundServer(build_app(engine, ServerSettings(served_model_name="tiny")))
        try:
            yield server
        finally:
            server.stop()


def _body(route: str, stream: bool, constrained: bool = True) -> dict:
    body = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 5, "stream": stream}
    if constrained:
        body["structured_outputs"] = CHOICE
    if route == "/v1/completions":
        return {**body, "prompt": "Colour:"}
    return {**body, "messages": [{"role": "user", "content": "Pick a colour."}]}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_failed_completion_is_a_500_not_a_stop(server, route):
    r = httpx.post(server.base_url + route, json=_body(route, stream=False), timeout=120)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "generation_error")
    ok = httpx.post(server.base_url + route, json=_body(route, stream=False, constrained=False), timeout=120)
    assert ok.status_code == 200, ok.text  # the server goes on serving


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_failed_stream_ends_with_the_error_event(server, route):
    with httpx.stream("POST", server.base_url + route, json=_body(route, stream=True), timeout=120) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert (last["error"]["type"], last["error"]["code"]) == ("server_error", "generation_error")
    chunks = [json.loads(e) for e in events[:-2]]
    assert all(choice.get("finish_reason") is None for c in chunks for choice in c.get("choices", []))
