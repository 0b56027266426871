"""What the server hands the engine: token ids tokenized off the engine thread, with cache_salt.

Text prompts and chat templates are tokenized on the app's tokenizer thread, never on
the engine thread (a long prompt would stall every running request's next token) nor on
the event loop; the engine gets `{"prompt_token_ids": ids}` equal to what it would have
tokenized itself, plus `"cache_salt"` when the request has one, and requests with
different salts share no prefix-cache blocks. Runs on the shared SmolLM2 `live_server`
(server_harness.py); empty or mistyped salts are 400s in test_server_errors.py.
"""

import threading

import pytest

from tests.helpers.server_harness import CHAT_MESSAGES, COMPLETION_PROMPTS, MODEL, chat_ids

HITS = ("paged_jax_prefix_cache_hits_total", ())


@pytest.fixture
def engine_prompts(live_server, monkeypatch):
    """Every prompt the engine thread passes to add_request while the test runs."""
    seen, add_request = [], live_server.engine.add_request

    def spy(request_id, prompt, *args, **kwargs):
        seen.append(prompt)
        return add_request(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(live_server.engine, "add_request", spy)
    return seen


def spy_threads(monkeypatch, obj, name: str) -> list[str]:
    """The names of the threads that call obj.<name> from now on."""
    threads, method = [], getattr(obj, name)

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return method(*args, **kwargs)

    monkeypatch.setattr(obj, name, spy)
    return threads


def test_text_prompts_reach_the_engine_as_ids_tokenized_off_the_engine_thread(live_server, engine_prompts,
                                                                               monkeypatch):
    tokenizer = live_server.engine.tokenizer
    want = [{"prompt_token_ids": list(tokenizer.encode(p))} for p in COMPLETION_PROMPTS[:2]]
    threads = spy_threads(monkeypatch, tokenizer, "encode")
    r = live_server.post("/v1/completions", json={"model": MODEL, "prompt": COMPLETION_PROMPTS[:2],
                                                  "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert engine_prompts == want
    assert r.json()["usage"]["prompt_tokens"] == sum(len(p["prompt_token_ids"]) for p in want)
    assert len(threads) == 2 and all(t.startswith("paged_jax-tokenizer") for t in threads), threads


def test_chat_templates_are_rendered_off_the_event_loop(live_server, engine_prompts, monkeypatch):
    tokenizer = live_server.engine.tokenizer
    want = {"prompt_token_ids": chat_ids(tokenizer, CHAT_MESSAGES[0])}
    threads = spy_threads(monkeypatch, tokenizer, "apply_chat_template")
    r = live_server.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT_MESSAGES[0],
                                                       "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert engine_prompts == [want]
    assert threads and all(t.startswith("paged_jax-tokenizer") for t in threads), threads


def test_cache_salt_reaches_the_engine_and_separates_prefix_caches(live_server, engine_prompts):
    """Needs an engine whose add_request takes the "cache_salt" key of a dict prompt."""
    prompt = "Salted prefix test: " + " ".join(f"word{i}" for i in range(40))  # several full 16-token blocks

    def complete(path="/v1/completions", **fields):
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0, **fields}
        body.update({"messages": CHAT_MESSAGES[1]} if "chat" in path else {"prompt": fields.get("prompt", prompt)})
        r = live_server.post(path, json=body)
        assert r.status_code == 200, r.text
        live_server.wait_idle()
        return live_server.metrics()[HITS]

    before = live_server.metrics()[HITS]
    first_a = complete(cache_salt="tenant-a")
    again_a = complete(cache_salt="tenant-a")
    first_b = complete(cache_salt="tenant-b")
    unsalted = complete()
    assert first_a == before  # a new prefix
    assert again_a > first_a  # the same salt shares the cached blocks
    assert first_b == again_a and unsalted == first_b  # another salt, or none, shares nothing
    complete(prompt=[5, 6, 7], cache_salt="tenant-a")
    complete("/v1/chat/completions", cache_salt="tenant-c")
    salts = [p.get("cache_salt") for p in engine_prompts]
    assert salts == ["tenant-a", "tenant-a", "tenant-b", None, "tenant-a", "tenant-c"]
    assert "cache_salt" not in engine_prompts[3]  # no salt: the key is left out, not sent as None
