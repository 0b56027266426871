"""What schema fuzzing (test_fuzz_schema.py, experiments/fuzz_server.py) found, kept fixed.

- A text content part whose `text` was not a string (`{"type": "text", "text": 60.0}`,
  or no `text` at all) was served: it failed the TextContentPart model, validated as a
  plain dict, and request_mapping.chat_messages str()-ed its text ("60.0", "None"). It is
  a 400 now, on /v1/chat/completions and /tokenize alike.
- Whole numbers written with a fraction (`"n": 2.0`, token ids `[1.0]`) were 400s
  although the OpenAPI schema says "integer" (JSON Schema's integer matches 2.0, and
  schemathesis sends such values): json_body.py reads them as the integers they are.
  Numbers with a real fraction are still refused where an integer belongs.
- A temperature above the largest float32 (1e39) was served: the engine samples in
  float32, where it is inf, and logits / inf are 0 (NaN under a structured-output mask):
  top-k and min-p were ignored and a `choice` constraint gave "". It is a 400 now (and
  the schema's maximum).
- A streamed token holding U+2028, U+2029 or NEL went out raw in its event's JSON:
  legal SSE, but a client that reads lines with str.splitlines (httpx's and requests'
  iter_lines) cut the event there. Such characters are JSON escapes in events now.
- The OpenAPI document itself: /metrics said JSON (it answers Prometheus text), the
  completion routes documented no body, and the bounds that depend on this server were
  missing (openapi_docs.py fills them in).
"""

import json

import httpx
import pytest

from paged_jax.entrypoints.openai.protocol import LIMIT
from paged_jax.entrypoints.openai.request_mapping import max_logprobs
from tests.helpers.server_harness import MODEL, assert_error


def _completion(**fields):
    return dict({"model": MODEL, "prompt": "Hello", "max_tokens": 2}, **fields)


def _chat(**fields):
    return dict({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, **fields)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 60.0}]}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": ["b"]}]}])),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": None, "x": 1}]}]}),
])
def test_a_text_part_without_string_text_is_a_400(live_server, path, body):
    error = assert_error(live_server.post(path, json=body), 400, "text must be a string")
    assert error["param"] == "messages"
    live_server.assert_all_blocks_free()


def test_whole_numbers_written_with_a_fraction_are_integers(live_server):
    ints = live_server.post("/v1/completions", json=_completion(temperature=0, n=2, max_tokens=3, prompt=[1, 2]))
    floats = live_server.post("/v1/completions", json=_completion(temperature=0.0, n=2.0, max_tokens=3.0,
                                                                  prompt=[1.0, 2e0]))
    assert ints.status_code == floats.status_code == 200, floats.text
    assert [c["text"] for c in floats.json()["choices"]] == [c["text"] for c in ints.json()["choices"]]
    assert live_server.post("/detokenize", json={"tokens": [1.0, 20.0]}).json() == \
        live_server.post("/detokenize", json={"tokens": [1, 20]}).json()
    for body in (_completion(n=1.5), _completion(max_tokens=2.5), _completion(prompt=[1, 2.5])):
        assert_error(live_server.post("/v1/completions", json=body), 400)
    assert_error(live_server.post("/detokenize", json={"tokens": [1.5]}), 400, "tokens")
    live_server.assert_all_blocks_free()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", _completion(temperature=1e39)),
    ("/v1/chat/completions", _chat(temperature=1e39, structured_outputs={"choice": ["yes", "no"]})),
])
def test_a_temperature_beyond_float32_is_a_400(live_server, path, body, stream):
    error = assert_error(live_server.post(path, json=dict(body, stream=stream)), 400, "temperature must be at most")
    assert error["param"] == "temperature"
    largest = live_server.post(path, json=dict(body, temperature=3.4028234663852886e38, stream=stream))
    assert largest.status_code == 200, largest.text


def test_streamed_line_separators_are_escaped(live_server):
    """A choice constraint makes the completion exactly the text with U+2028, U+2029 and NEL."""
    text = "a\u2028b\u2029c\x85d"
    body = _completion(temperature=0, max_tokens=16, structured_outputs={"choice": [text]}, stream=True)
    r = live_server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert not any(c in r.text for c in "\u2028\u2029\x85"), "a raw line separator in the stream"
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]) == text
    whole = live_server.post("/v1/completions", json=dict(body, stream=False))
    assert whole.json()["choices"][0]["text"] == text


def _markers(node) -> list:
    if isinstance(node, dict):
        return ([node[LIMIT]] if LIMIT in node else []) + [m for v in node.values() for m in _markers(v)]
    if isinstance(node, list):
        return [m for v in node for m in _markers(v)]
    return []


def test_the_openapi_document_says_what_this_server_takes(live_server):
    spec = httpx.get(live_server.base_url + "/openapi.json", timeout=30).json()
    schemas, paths = spec["components"]["schemas"], spec["paths"]
    assert _markers(spec) == []  # every server bound filled in
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert completion["model"]["enum"] == [MODEL] and chat["model"]["enum"] == [MODEL]
    vocab = live_server.engine.model_config.vocab_size
    token_lists = [b for b in completion["prompt"]["anyOf"] if b["type"] == "array"]
    assert token_lists[1]["items"] == {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    limit = max_logprobs(live_server.engine)
    assert completion["logprobs"]["anyOf"][0]["maximum"] == limit == chat["top_logprobs"]["anyOf"][0]["maximum"]
    assert completion["priority"]["enum"] == [0]  # the server runs fcfs
    assert completion["n"]["minimum"] == 1 and completion["temperature"]["anyOf"][0]["minimum"] == 0
    assert completion["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = paths[path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
        assert op["security"] == [{"bearer": []}]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "security" not in paths["/health"]["get"] and "security" not in paths["/metrics"]["get"]
    assert spec["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer",
                                                               "description": "Authorization: Bearer <--api_key>"}
