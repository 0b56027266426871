"""Completions `echo` (with and without generation), vLLM's `prompt_logprobs` and chat
`echo` on the live server, against the engine's own offline outputs for the same prompts
(`tests/helpers/server_harness.py` runs them with prompt_logprobs=3 before the server
starts). `echo: true, max_tokens: 0, logprobs: 1` is lm-evaluation-harness's loglikelihood
request; the lm-eval run itself is tests/entrypoints/test_lm_eval.py."""

import json

import pytest

from tests.helpers.server_harness import COMPLETION_PROMPTS, MODEL


def _prompt_positions(offline):
    """Offline prompt logprobs: per prompt token after the first, (token, its logprob, {token: logprob})."""
    out = []
    for t, position in zip(offline.prompt_token_ids[1:], offline.prompt_logprobs[1:]):
        out.append((t, position[t].logprob, {u: lp.logprob for u, lp in position.items()}))
    return out


def _stream_completion(live, body) -> dict:
    """A streamed completion's single choice, its chunks joined (text, logprobs lists, finish)."""
    text, tokens, token_logprobs, tops, offsets, finish, extra = "", [], [], [], [], None, {}
    r = live.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        text += choice["text"]
        if choice.get("logprobs"):
            lp = choice["logprobs"]
            tokens += lp["tokens"]
            token_logprobs += lp["token_logprobs"]
            tops += lp["top_logprobs"] or []
            offsets += lp["text_offset"]
        finish = choice["finish_reason"] or finish
        for key in ("prompt_logprobs", "prompt_token_ids"):
            if key in choice:
                extra[key] = choice[key]
    return {"text": text, "finish_reason": finish, "logprobs": {"tokens": tokens, "token_logprobs": token_logprobs,
                                                                 "top_logprobs": tops, "text_offset": offsets},
            **extra}


def _completion_choice(live, body, stream: bool):
    """(the single choice, usage or None) of a completion, streamed (chunks joined) or not."""
    if stream:
        return _stream_completion(live, body), None
    r = live.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0], r.json()["usage"]


def _check_prompt_part(live, logprobs, offline, k):
    tokenizer = live.loaded.tokenizer
    ids = offline.prompt_token_ids
    n = len(ids)
    assert logprobs["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, (t, lp, top) in enumerate(_prompt_positions(offline), start=1):
        assert logprobs["token_logprobs"][i] == pytest.approx(lp, abs=1e-4)
        sent = logprobs["top_logprobs"][i]
        # the prompt token and the k best, as vLLM sends them: a greedy check compares with max(sent)
        best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        expected = {tokenizer.decode([t]): lp, **{tokenizer.decode([u]): v for u, v in best}}
        assert sent.keys() == expected.keys()
        for key, value in expected.items():
            assert sent[key] == pytest.approx(value, abs=1e-4)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(tok) for a, b, tok in zip(offsets, offsets[1:], logprobs["tokens"]))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_generation_scores_the_prompt(live_server, stream):
    prompt = COMPLETION_PROMPTS[0]
    offline = live_server.offline["prompt-logprobs-0"]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    choice, usage = _completion_choice(live_server, body, stream)
    assert stream or usage["completion_tokens"] == 0
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(offline.prompt_token_ids)  # nothing generated is returned
    _check_prompt_part(live_server, choice["logprobs"], offline, k=1)
    live_server.assert_all_blocks_free()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_generation_puts_the_prompt_first(live_server, stream):
    prompt = COMPLETION_PROMPTS[1]
    offline = live_server.offline["prompt-logprobs-1"]
    completion = offline.outputs[0]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 16, "logprobs": 2, "temperature": 0}
    choice, _ = _completion_choice(live_server, body, stream)
    assert choice["text"] == prompt + completion.text
    n = len(offline.prompt_token_ids)
    lps = choice["logprobs"]
    _check_prompt_part(live_server, lps, offline, k=2)
    assert len(lps["tokens"]) == n + len(completion.token_ids)
    assert lps["token_logprobs"][n:] == pytest.approx(completion.logprobs, abs=1e-4)
    offsets = lps["text_offset"]
    assert all(b - a == len(tok) for a, b, tok in zip(offsets, offsets[1:], lps["tokens"]))


def test_prompt_logprobs_field_and_token_id_prompt_echo(live_server):
    offline = live_server.offline["prompt-logprobs-0"]
    ids = list(offline.prompt_token_ids)
    r = live_server.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 2,
                                                  "temperature": 0, "prompt_logprobs": 3, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(live_server.loaded.tokenizer.decode(ids))
    assert choice["prompt_token_ids"] == ids
    sent = choice["prompt_logprobs"]
    assert len(sent) == len(ids) and sent[0] is None
    for position, expected in zip(sent[1:], offline.prompt_logprobs[1:]):
        assert set(position) == {str(t) for t in expected}
        for t, lp in expected.items():
            assert position[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert position[str(t)]["rank"] == lp.rank and position[str(t)]["decoded_token"] == lp.decoded_token


def test_openai_client_echo_and_chat_echo(live_server):
    client = live_server.openai()
    out = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS[0], echo=True, max_tokens=0, logprobs=1)
    assert out.choices[0].text == COMPLETION_PROMPTS[0] and out.choices[0].logprobs.token_logprobs[0] is None
    start = "The capital of France is"
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, extra_body={"echo": True},
                                          messages=[{"role": "user", "content": "Complete the sentence."},
                                                    {"role": "assistant", "content": start}])
    assert chat.choices[0].message.content.startswith(start)
    plain = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, extra_body={"echo": True},
                                           messages=[{"role": "user", "content": "Hi"}])
    assert not plain.choices[0].message.content.startswith("Hi")  # only an assistant message is echoed
