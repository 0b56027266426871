"""Beam search over the API (vLLM's `use_beam_search`): the served beams are the engine's own.

`n` beams come back best first, whole or streamed, on completions and chat, equal token
for token to LLMEngine's beam search on the same prompt (run alone before the server
started, as the server runs it); what a beam search cannot honour is a 400 naming the
field, and the beams' forked blocks are all freed afterwards.
"""

import json

import httpx
import pytest

from tests.helpers.server_harness import (API_KEY, BEAM_CHAT, BEAM_COMPLETION, CHAT_MESSAGES, COMPLETION_PROMPTS,
                                          MODEL, assert_error)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _completion_body(**fields):
    return dict({"model": MODEL, "prompt": COMPLETION_PROMPTS[0], "use_beam_search": True,
                 "n": BEAM_COMPLETION["beam_width"], "max_tokens": BEAM_COMPLETION["max_tokens"],
                 "length_penalty": BEAM_COMPLETION["length_penalty"], "return_token_ids": True}, **fields)


def _chat_body(**fields):
    return dict({"model": MODEL, "messages": CHAT_MESSAGES[0], "use_beam_search": True,
                 "n": BEAM_CHAT["beam_width"], "max_completion_tokens": BEAM_CHAT["max_tokens"],
                 "return_token_ids": True, "temperature": 0}, **fields)


def _stream(live, path, body) -> dict[int, dict]:
    """Per choice index: its streamed text, token ids and finish reason."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", live.base_url + path, json=dict(body, stream=True), headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            got = choices.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
            got["text"] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            got["token_ids"] += c.get("token_ids") or []
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return choices


def _want(live, key):
    return [(list(c.token_ids), c.text, c.finish_reason) for c in live.offline[key].outputs]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_beams_equal_the_engines(live_server, stream):
    want = _want(live_server, "beam-completion")
    assert len(want) == BEAM_COMPLETION["beam_width"] and len({tuple(w[0]) for w in want}) == len(want)
    if stream:
        got = _stream(live_server, "/v1/completions", _completion_body())
        served = [(got[i]["token_ids"], got[i]["text"], got[i]["finish_reason"]) for i in sorted(got)]
    else:
        r = live_server.post("/v1/completions", json=_completion_body())
        assert r.status_code == 200, r.text
        body = r.json()
        served = [(c["token_ids"], c["text"], c["finish_reason"]) for c in body["choices"]]
        assert [c["index"] for c in body["choices"]] == list(range(len(want)))
        assert body["usage"]["completion_tokens"] == sum(len(w[0]) for w in want)
    assert served == want
    live_server.assert_all_blocks_free()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_beams_equal_the_engines(live_server, stream):
    want = _want(live_server, "beam-chat")
    if stream:
        got = _stream(live_server, "/v1/chat/completions", _chat_body())
        served = [(got[i]["token_ids"], got[i]["text"], got[i]["finish_reason"]) for i in sorted(got)]
    else:
        r = live_server.post("/v1/chat/completions", json=_chat_body())
        assert r.status_code == 200, r.text
        served = [(c["token_ids"], c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]]
    assert served == want
    live_server.assert_all_blocks_free()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", _completion_body(stop=["."]), "stop"),
    ("/v1/completions", _completion_body(stop_token_ids=[2]), "stop_token_ids"),
    ("/v1/completions", _completion_body(logprobs=1), "logprobs"),
    ("/v1/completions", _completion_body(prompt_logprobs=1), "prompt_logprobs"),
    ("/v1/completions", _completion_body(top_k=5), "top_k"),
    ("/v1/completions", _completion_body(top_p=0.5), "top_p"),
    ("/v1/completions", _completion_body(min_p=0.1), "min_p"),
    ("/v1/chat/completions", _chat_body(logprobs=True), "logprobs"),
    ("/v1/chat/completions", _chat_body(response_format={"type": "json_object"}), "response_format"),
    ("/v1/chat/completions", _chat_body(structured_outputs={"regex": "[ab]+"}), "structured_outputs"),
])
def test_what_beams_cannot_honour_is_a_400(live_server, path, body, param):
    error = assert_error(live_server.post(path, json=body), 400, "with use_beam_search")
    assert error["param"] == param
    live_server.assert_all_blocks_free()


def test_beam_width_and_length_penalty_limits(live_server):
    # 2 * width candidates per beam must fit the engine's top-k (max_logprobs): the engine's refusal is a 400
    assert_error(live_server.post("/v1/completions", json=_completion_body(n=64)), 400, "beam_width=64")
    error = assert_error(live_server.post("/v1/completions", json=dict(_completion_body(), use_beam_search=None)),
                         400, "length_penalty only applies to beam search")
    assert error["param"] == "length_penalty"
    live_server.assert_all_blocks_free()
