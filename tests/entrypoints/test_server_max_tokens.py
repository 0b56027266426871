"""`max_tokens` past the context a prompt leaves is a 400, as vLLM answers it (it used to
be cut to the context left, silently): on /v1/completions and /v1/chat/completions, also
as `max_completion_tokens`, with the prompt's length, max_tokens and max_model_len in the
message. Exactly at the boundary (prompt + max_tokens == max_model_len) a request runs to
max_tokens; without max_tokens it gets the context left, and no error.

A tiny random-weight model with SmolLM2's real tokenizer (chat needs its template); the
chat prompt's length comes from transformers' own apply_chat_template."""

import httpx
import pytest

from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
from paged_jax.loading import load_model
from tests.helpers.tiny_smollm2_vocab import save_tiny_smollm2_vocab

MAX_MODEL_LEN = 64
PROMPT = list(range(100, 110))  # 10 token ids
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_smollm2_vocab"))
    _, tokenizer = save_tiny_smollm2_vocab(path)
    engine = LLMEngine(load_model(path), EngineConfig(block_size=8, num_blocks=64, max_model_len=MAX_MODEL_LEN,
                                                      max_num_seqs=4, max_num_batched_tokens=64,
                                                      seq_buckets=(4,), token_buckets=(8, 64)))
    server = BackgroundServer(build_app(engine, ServerSettings(served_model_name="tiny")))
    server.chat_prompt_len = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False))
    try:
        yield server
    finally:
        server.stop()


def _post(server, route: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES})
    return httpx.post(server.base_url + route, json=body, timeout=120)


def _num_tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return [len(c["token_ids"]) for c in r.json()["choices"]]


def _prompt_len(server, route: str) -> int:
    return len(PROMPT) if route == "/v1/completions" else server.chat_prompt_len


@pytest.mark.parametrize("route, field", [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                                          ("/v1/chat/completions", "max_completion_tokens")])
def test_max_tokens_past_the_context_is_a_400_and_the_boundary_runs(server, route, field):
    room = MAX_MODEL_LEN - _prompt_len(server, route)
    assert _num_tokens(_post(server, route, **{field: room})) == [room]  # prompt + max_tokens == max_model_len
    for asked in (room + 1, 100000):
        r = _post(server, route, **{field: asked})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", field)
        for part in (f"{MAX_MODEL_LEN} tokens", f"{_prompt_len(server, route) + asked} tokens",
                     f"{_prompt_len(server, route)} in the prompt", f"max_tokens={asked}"):
            assert part in error["message"], error["message"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_without_max_tokens_a_request_gets_the_context_left(server, route):
    room = MAX_MODEL_LEN - _prompt_len(server, route)
    assert _num_tokens(_post(server, route, max_tokens=None, n=2)) == [room, room]


def test_a_batch_is_refused_when_one_prompt_leaves_too_little_room(server):
    body = {"model": "tiny", "prompt": [PROMPT, PROMPT[:2]], "max_tokens": MAX_MODEL_LEN - 5}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and f"{len(PROMPT)} in the prompt" in r.json()["error"]["message"], r.text
