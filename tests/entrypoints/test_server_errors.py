"""Every bad request gets its 4xx in OpenAI's error shape, and the server keeps serving.

Malformed JSON, wrong types, prompts the engine refuses, bad sampling values, arguments
the engine cannot honour, an unknown model (404, as OpenAI), a missing API key (401),
a too-large body (413) and a full waiting queue (503). After each: nothing was queued,
nothing leaked, and a good request still succeeds.
"""

import asyncio

import httpx
import pytest

from paged_jax.entrypoints.openai.request_mapping import max_logprobs
from tests.helpers.server_harness import API_KEY, MAX_BODY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]


def _completion(**fields):
    return dict({"model": MODEL, "prompt": "Hello", "max_tokens": 2}, **fields)


def _chat(**fields):
    return dict({"model": MODEL, "messages": CHAT, "max_tokens": 2}, **fields)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    for word in words:
        assert word in error["message"], error["message"]
    return error


def assert_still_serving(live) -> None:
    live.assert_all_blocks_free()  # nothing from the refused request was queued or leaked
    r = live.post("/v1/completions", json=_completion(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


BAD_BODIES = [  # (path, raw body or dict, words the message must contain, param)
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ', "not valid JSON", None),
    ("/v1/completions", b'["a list"]', "JSON object", None),
    ("/v1/completions", _completion(max_tokens="ten"), "max_tokens", "max_tokens"),
    ("/v1/completions", _completion(temperature="hot"), "temperature", "temperature"),
    ("/v1/completions", _completion(stream="yes"), "stream", "stream"),
    ("/v1/completions", _completion(prompt=5), "prompt", "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x"}, "model", "model"),
    ("/v1/completions", _completion(prompt="word " * 600), "max_model_len is 512", "prompt"),
    ("/v1/completions", _completion(prompt=[1, 10**6]), "outside the vocabulary", "prompt"),
    ("/v1/completions", _completion(prompt=""), "empty", "prompt"),
    ("/v1/completions", _completion(prompt=[]), "empty", "prompt"),
    ("/v1/completions", _completion(prompt=["fine", "word " * 600]), "max_model_len", "prompt"),
    ("/v1/completions", _completion(temperature=-1), "temperature must be >= 0", "temperature"),
    ("/v1/completions", _completion(top_p=0), "top_p", "top_p"),
    ("/v1/completions", _completion(top_p=1.5), "top_p", "top_p"),
    ("/v1/completions", _completion(top_k=-2), "top_k", "top_k"),
    ("/v1/completions", _completion(min_p=2), "min_p", "min_p"),
    ("/v1/completions", _completion(n=0), "n must be", "n"),
    ("/v1/completions", _completion(max_tokens=0), "max_tokens", "max_tokens"),
    ("/v1/completions", _completion(seed=-1), "seed", "seed"),
    ("/v1/completions", _completion(stop=[""]), "stop", "stop"),
    ("/v1/completions", _completion(prompt_logprobs=1000), "prompt_logprobs", "prompt_logprobs"),
    ("/v1/completions", _completion(prompt_logprobs=-1), "prompt_logprobs", "prompt_logprobs"),
    ("/v1/completions", _completion(priority=1), "scheduling_policy", "priority"),  # the server runs fcfs
    ("/v1/chat/completions", _chat(priority=-2), "scheduling_policy", "priority"),
    ("/v1/completions", _completion(priority="high"), "priority", "priority"),
    ("/v1/chat/completions", _chat(prompt_logprobs=1000), "prompt_logprobs", "prompt_logprobs"),
    ("/v1/completions", _completion(best_of=3), "best_of", "best_of"),
    ("/v1/completions", _completion(suffix="x"), "suffix", "suffix"),
    ("/v1/completions", _completion(logit_bias={"5": 1}), "logit_bias", "logit_bias"),
    # beam search: what it cannot honour is refused, never silently dropped
    ("/v1/completions", _completion(use_beam_search=True, stop=["."]), "not supported with use_beam_search", "stop"),
    ("/v1/chat/completions", _chat(length_penalty=0.5), "only applies to beam search", "length_penalty"),
    ("/v1/completions", _completion(presence_penalty=0.5), "presence_penalty", "presence_penalty"),
    ("/v1/completions", _completion(stream_options={"include_usage": True}), "stream_options", "stream_options"),
    ("/v1/completions", _completion(cache_salt=""), "cache_salt must be a non-empty string", "cache_salt"),
    ("/v1/completions", _completion(cache_salt=7), "cache_salt", "cache_salt"),
    ("/v1/chat/completions", _chat(cache_salt=""), "cache_salt must be a non-empty string", "cache_salt"),
    ("/v1/chat/completions", _chat(messages=[]), "messages", "messages"),
    ("/v1/chat/completions", _chat(messages="hi"), "messages", "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}]), "messages", "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "only text", "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "word " * 600}]), "max_model_len",
     "messages"),
    ("/v1/chat/completions", _chat(top_logprobs=1), "needs logprobs", "top_logprobs"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function"}]), "tools", "tools"),
    ("/v1/chat/completions", _chat(response_format={"type": "xml"}), "response_format", "response_format"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "schema",
     "response_format"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                                        "maximum": 1}}, "required": ["a"]}}}),
     "invalid structured_outputs.json", "response_format"),  # llguidance: an empty integer range
    ("/v1/completions", _completion(structured_outputs={"regex": "(unclosed"}), "invalid structured_outputs.regex",
     "structured_outputs"),
    ("/v1/completions", _completion(structured_outputs={"grammar": "root ::= ("}), "invalid structured_outputs",
     "structured_outputs"),
    ("/v1/completions", _completion(structured_outputs={"choice": []}), "choice", "structured_outputs"),
    ("/v1/completions", _completion(structured_outputs={"regex": "a", "choice": ["b"]}), "exactly one",
     "structured_outputs"),
    ("/v1/completions", _completion(structured_outputs={"xml": "<a/>"}), "unknown", "structured_outputs"),
    ("/v1/completions", _completion(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
     "not both", "response_format"),
    ("/v1/chat/completions", _chat(temperature=-0.5), "temperature", "temperature"),
    # the first fuzzing pass: each of these reached the engine step or a 500 before
    ("/v1/completions", _completion(top_k=2**31), "top_k", "top_k"),  # OverflowError in the i32 batch
    ("/v1/completions", _completion(top_k=10**30), "top_k", "top_k"),
    ("/v1/chat/completions", _chat(top_k=2**31), "top_k", "top_k"),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "Hi", "temperature": NaN}', "finite", None),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "Hi", "top_p": Infinity}', "finite", None),
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [], "temperature": 1e309}', "out of range",
     None),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
     "nested too deeply", None),
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "\\ud800"}', "surrogate", None),  # JSON escape
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "a\xed\xa0\x80b"}', "surrogate", None),  # raw bytes
    ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "surrogate", None),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body, words, param", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_is_a_400_with_a_message(live_server, path, body, words, param, stream):
    if isinstance(body, bytes):
        r = live_server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        if stream and "stream" not in body and "stream_options" not in body:
            body = dict(body, stream=True)  # a streamed request is refused the same way, before any event
        r = live_server.post(path, json=body)
    error = assert_error(r, 400, words)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_the_server_keeps_serving_after_bad_input(live_server):
    key = ("paged_jax_request_rejected_total", (("reason", "bad_request"),))
    before = live_server.metrics()[key]
    bad = BAD_BODIES[:3] + BAD_BODIES[8:14]
    for path, body, _, _ in bad:
        live_server.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert live_server.metrics()[key] - before == len(bad)  # each refusal is counted
    assert_still_serving(live_server)


def test_logprobs_beyond_what_the_engine_returns(live_server):
    limit = max_logprobs(live_server.engine)
    r = live_server.post("/v1/completions", json=_completion(logprobs=limit + 1))
    assert_error(r, 400, f"logprobs={limit + 1}")
    r = live_server.post("/v1/chat/completions", json=_chat(logprobs=True, top_logprobs=limit + 1))
    assert_error(r, 400, f"top_logprobs={limit + 1}")
    if limit == 1:  # an engine with no alternatives says so
        assert "only the sampled token's logprob" in r.json()["error"]["message"]
    assert_still_serving(live_server)


def test_unknown_model_is_404_model_not_found(live_server):
    for path, body in [("/v1/completions", _completion(model="gpt-4")), ("/v1/chat/completions", _chat(model="x"))]:
        error = assert_error(live_server.post(path, json=body), 404, repr(body["model"]), MODEL)
        assert error["code"] == "model_not_found" and error["param"] == "model"
    assert_error(live_server.post("/v1/nothing-here", json={}), 404)


def test_api_key(live_server):
    url = live_server.base_url + "/v1/completions"
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}]:
        error = assert_error(httpx.post(url, json=_completion(), headers=headers), 401, "API key")
        assert error["code"] == "invalid_api_key"
    assert_error(httpx.get(live_server.base_url + "/v1/models"), 401)
    assert httpx.get(live_server.base_url + "/v1/models", headers=AUTH).status_code == 200
    # the openai client with a wrong key gets its AuthenticationError
    import openai
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(live_server.base_url + "/health").status_code == 200  # not behind the key


def test_body_size_limit(live_server):
    big = _completion(prompt="x" * (MAX_BODY + 10))
    assert_error(live_server.post("/v1/completions", json=big), 413, "exceeds the limit")

    def chunks():  # no Content-Length: the limit still holds
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    assert_error(live_server.post("/v1/completions", content=chunks()), 413, "exceeds the limit")
    assert_still_serving(live_server)


def test_full_waiting_queue_is_503_and_nothing_is_lost(live_server):
    loop = live_server.loop
    live_server.wait_idle()
    key = ("paged_jax_request_rejected_total", (("reason", "server_busy"),))
    before = live_server.metrics()[key]
    bound = loop.max_waiting_requests
    try:
        loop.max_waiting_requests = 0  # every new request finds the queue full
        error = assert_error(live_server.post("/v1/completions", json=_completion()), 503, "waiting queue is full")
        assert error["type"] == "server_error" and error["code"] == "server_busy"
        loop.max_waiting_requests = bound
        asyncio.run(_fill_and_overflow(live_server, 2))
    finally:
        loop.max_waiting_requests = bound
    assert loop.stats()["num_pending"] == 0  # the admission count went back to zero
    assert live_server.metrics()[key] - before == 2
    assert_still_serving(live_server)


async def _fill_and_overflow(live, bound: int):
    """16 long requests fill every running slot (max_num_seqs=16); with the bound at 2,
    two more wait and the next one finds the queue full. Then every stream is read to
    its end: none is lost."""
    async with httpx.AsyncClient(base_url=live.base_url, headers=AUTH, timeout=120) as client:
        body = _completion(max_tokens=24, ignore_eos=True, stream=True, temperature=0)

        async def open_stream():
            request = client.build_request("POST", "/v1/completions", json=body)
            response = await client.send(request, stream=True)
            assert response.status_code == 200
            return response

        running = [await open_stream() for _ in range(16)]
        while live.loop.stats()["num_running"] < 16:  # all admitted into the batch
            await asyncio.sleep(0.02)
        live.loop.max_waiting_requests = bound
        waiting = [await open_stream() for _ in range(bound)]
        r = await client.post("/v1/completions", json=body)
        assert_error(r, 503, "waiting queue is full")
        for response in running + waiting:
            events = [line async for line in response.aiter_lines() if line]
            assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
            await response.aclose()
