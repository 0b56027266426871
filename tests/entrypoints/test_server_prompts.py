"""What the server hands the engine: token ids tokenized off the engine thread, with cache_salt;
and what it gets back: token ids, detokenized off the engine thread too.

Text prompts and chat templates are tokenized on the app's tokenizer thread, never on
the engine thread (a long prompt would stall every running request's next token) nor on
the event loop; the engine gets `{"prompt_token_ids": ids}` equal to what it would have
tokenized itself, plus `"cache_salt"` when the request has one, and requests with
different salts share no prefix-cache blocks. The engine thread steps the engine core
only; text and stop strings are worked out on the event loop, and a stop string found
there ends its request in the core. Runs on the shared SmolLM2 `live_server`
(server_harness.py); empty or mistyped salts are 400s in test_server_errors.py.
"""

import threading

import pytest

from tests.helpers.server_harness import CHAT_MESSAGES, COMPLETION_PROMPTS, MODEL, chat_ids

HITS = ("paged_jax_prefix_cache_hits_total", ())


@pytest.fixture
def engine_prompts(live_server, monkeypatch):
    """Every prompt the server hands the engine (its processor checks them, then the
    engine core gets their token ids) while the test runs."""
    seen, process = [], live_server.engine.processor.process

    def spy(prompt):
        seen.append(prompt)
        return process(prompt)

    monkeypatch.setattr(live_server.engine.processor, "process", spy)
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


def test_outputs_are_detokenized_off_the_engine_thread_and_stop_strings_end_requests_in_the_core(live_server,
                                                                                                  monkeypatch):
    """Every RequestOutput is built (text, stop strings) on the event loop, never on the
    engine thread; a stop string found there frees the request's blocks in the core."""
    offline = live_server.offline["completion-0"]
    text = offline.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # occurs in the greedy text, so it must cut it there
    assert len(stop) == 3 and stop.strip()
    loop = live_server.loop
    threads = spy_threads(monkeypatch, loop.output_processor, "process")
    step_threads = spy_threads(monkeypatch, loop.core, "step")
    r = live_server.post("/v1/completions", json={"model": MODEL, "prompt": COMPLETION_PROMPTS[0], "temperature": 0,
                                                  "max_tokens": len(offline.outputs[0].token_ids), "stop": [stop]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)]
    assert threads and not any(t.startswith("paged_jax-engine") for t in threads), threads
    assert step_threads and set(step_threads) == {"paged_jax-engine"}, set(step_threads)
    live_server.assert_all_blocks_free()  # the stop string finished the request in the core
    assert not loop.core.has_unfinished_requests() and not loop.output_processor._requests
