"""vLLM's /tokenize and /detokenize (tokenize_routes.py) on the shared SmolLM2 `live_server`.

Token ids equal the server's own encoding (a text prompt as /v1/completions encodes it,
messages as /v1/chat/completions hands them to the engine); tokenize -> detokenize gives
the text back; the work runs on the tokenizer thread and never reaches the engine; both
routes need the API key and refuse bad bodies with 400s in OpenAI's shape.
SmolLM2's tokenizer adds no special tokens, so `add_special_tokens` is checked on a
second app whose tokenizer prepends BOS (built with `build_app`, never started: these
routes need no engine thread).
"""

import copy
import threading
import types

import httpx
import pytest
from starlette.testclient import TestClient

from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai import request_mapping as rm
from paged_jax.entrypoints.openai.protocol import ChatCompletionRequest
from tests.helpers.server_harness import API_KEY, CHAT_MESSAGES, COMPLETION_PROMPTS, MODEL, assert_error

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = COMPLETION_PROMPTS + ["naïve café — 東京 🚀\n\ttabs", "<|im_start|>user\nHi<|im_end|>", "   ", ""]
STEPS = ("paged_jax_engine_steps_total", ())


def tokenize(live, **body) -> dict:
    r = live.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def detokenize(live, tokens) -> str:
    r = live.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def chat_route_ids(messages, tokenizer) -> list[int]:
    """What /v1/chat/completions computes for these messages (its own functions)."""
    return rm.chat_prompt_ids(rm.chat_messages(ChatCompletionRequest(model=MODEL, messages=messages)), tokenizer)


def offline_app(tokenizer, api_key: str | None = None) -> TestClient:
    """build_app on a stand-in engine holding `tokenizer`; its lifespan (the engine thread)
    never runs, which /tokenize and /detokenize do not need."""
    engine = types.SimpleNamespace(tokenizer=tokenizer, core=types.SimpleNamespace(stats=dict),
                                   config=types.SimpleNamespace(max_model_len=512, max_logprobs=1),
                                   model_config=types.SimpleNamespace(vocab_size=len(tokenizer or ())))
    return TestClient(build_app(engine, ServerSettings(served_model_name=MODEL, api_key=api_key)))


@pytest.fixture(scope="module")
def bos_tokenizer(live_server):
    """SmolLM2's tokenizer, but prepending BOS when it adds special tokens (as Llama's does)."""
    tokenizer = copy.deepcopy(live_server.engine.tokenizer)
    tokenizer.add_bos_token = True
    assert tokenizer.encode("Hi") == [tokenizer.bos_token_id] + tokenizer.encode("Hi", add_special_tokens=False)
    return tokenizer


def test_tokens_are_the_servers_encoding_and_never_reach_the_engine(live_server):
    tokenizer = live_server.engine.tokenizer
    live_server.wait_idle()
    steps = live_server.metrics()[STEPS]
    for text in TEXTS:
        got = tokenize(live_server, model=MODEL, prompt=text)
        want = list(tokenizer.encode(text))
        assert got["tokens"] == want == rm.prompt_token_ids([text], tokenizer)[0]  # as /v1/completions encodes
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == live_server.engine.config.max_model_len
        assert got["token_strs"] is None
    assert tokenize(live_server, prompt=TEXTS[0]) == tokenize(live_server, prompt=TEXTS[0], model=MODEL)  # optional
    assert tokenize(live_server, prompt=TEXTS[0], add_special_tokens=False)["tokens"] == \
        list(tokenizer.encode(TEXTS[0], add_special_tokens=False))
    assert live_server.metrics()[STEPS] == steps  # the engine did nothing


def test_tokenize_then_detokenize_gives_the_text_back(live_server):
    tokenizer = live_server.engine.tokenizer
    for text in TEXTS:
        tokens = tokenize(live_server, model=MODEL, prompt=text)["tokens"]
        assert detokenize(live_server, tokens) == text
    chat = tokenize(live_server, messages=CHAT_MESSAGES[0])["tokens"]
    assert detokenize(live_server, chat) == tokenizer.decode(chat, skip_special_tokens=False)  # specials kept
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in detokenize(live_server, chat)
    assert detokenize(live_server, []) == ""


def test_chat_form_equals_what_chat_completions_feeds_the_engine(live_server, monkeypatch):
    tokenizer = live_server.engine.tokenizer
    fed, process = [], live_server.engine.processor.process

    def spy(prompt):
        fed.append(prompt["prompt_token_ids"])
        return process(prompt)

    monkeypatch.setattr(live_server.engine.processor, "process", spy)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a river."}]}]
    for messages in CHAT_MESSAGES + [parts, [{"role": "developer", "content": "Be brief."}] + parts]:
        got = tokenize(live_server, model=MODEL, messages=messages)
        r = live_server.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert got["tokens"] == fed[-1] == chat_route_ids(messages, tokenizer)
        assert got["count"] == len(got["tokens"]) == r.json()["usage"]["prompt_tokens"]
    # without the assistant header, and continuing an open assistant message
    messages = CHAT_MESSAGES[0]
    no_prompt = tokenize(live_server, messages=messages, add_generation_prompt=False)["tokens"]
    assert no_prompt == list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                           return_dict=False))
    assert no_prompt != chat_route_ids(messages, tokenizer)
    opened = messages + [{"role": "assistant", "content": "The capital"}]
    cont = tokenize(live_server, messages=opened, add_generation_prompt=False, continue_final_message=True)["tokens"]
    assert detokenize(live_server, cont).endswith("<|im_start|>assistant\nThe capital")


def test_return_token_strs(live_server):
    tokenizer = live_server.engine.tokenizer
    for body in [dict(prompt=TEXTS[0]), dict(prompt=TEXTS[4]), dict(messages=CHAT_MESSAGES[1])]:
        got = tokenize(live_server, return_token_strs=True, **body)
        assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
        assert len(got["token_strs"]) == got["count"] > 0
    assert tokenize(live_server, prompt="Hello world", return_token_strs=True)["token_strs"] == ["Hello", "Ġworld"]


def test_add_special_tokens(bos_tokenizer):
    client = offline_app(bos_tokenizer)
    bos, text = bos_tokenizer.bos_token_id, COMPLETION_PROMPTS[0]
    plain = bos_tokenizer.encode(text, add_special_tokens=False)
    # the prompt form adds them by default, as /v1/completions encodes a text prompt
    assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == [bos] + plain
    assert client.post("/tokenize", json={"prompt": text, "add_special_tokens": True}).json()["tokens"] == [bos] + plain
    assert client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == plain
    # the chat form does not by default (the template has them), as /v1/chat/completions
    messages = CHAT_MESSAGES[0]
    chat = chat_route_ids(messages, bos_tokenizer)
    assert client.post("/tokenize", json={"messages": messages}).json()["tokens"] == chat
    got = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()
    assert got["tokens"] == [bos] + chat and got["count"] == len(chat) + 1


def test_tokenizing_runs_on_the_tokenizer_thread(live_server, monkeypatch):
    tokenizer, threads = live_server.engine.tokenizer, []
    for name in ("encode", "apply_chat_template", "decode"):
        method = getattr(tokenizer, name)

        def spy(*args, _method=method, **kwargs):
            threads.append(threading.current_thread().name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, spy)
    tokenize(live_server, prompt="x " * 5000)
    tokenize(live_server, messages=CHAT_MESSAGES[0])
    detokenize(live_server, [19556, 905])
    assert len(threads) >= 3 and all(t.startswith("paged_jax-tokenizer") for t in threads), threads


def test_api_key_is_required(live_server, bos_tokenizer):
    for path, body in [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [19556]})]:
        url = live_server.base_url + path
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]:
            error = assert_error(httpx.post(url, json=body, headers=headers, timeout=30), 401, "API key")
            assert error["code"] == "invalid_api_key"
        assert httpx.post(url, json=body, headers=AUTH, timeout=30).status_code == 200
        assert offline_app(bos_tokenizer).post(path, json=body).status_code == 200  # no --api_key: open


def test_unknown_model_is_the_completions_routes_error(live_server):
    want = live_server.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
    assert want.status_code == 404 and want.json()["error"]["code"] == "model_not_found"
    for path, body in [("/tokenize", {"prompt": "Hi"}), ("/tokenize", {"messages": CHAT_MESSAGES[0]}),
                       ("/detokenize", {"tokens": [1]})]:
        r = live_server.post(path, json=dict(body, model="gpt-4"))
        assert (r.status_code, r.json()) == (want.status_code, want.json())


BAD = [  # (path, dict or raw body, words the message must contain, param)
    ("/tokenize", b'{"prompt": "Hi"', "not valid JSON", None),
    ("/tokenize", b'["Hi"]', "JSON object", None),
    ("/tokenize", b'{"prompt": "\\ud800"}', "surrogate", None),
    ("/tokenize", b'{"prompt": "a\xed\xa0\x80b"}', "surrogate", None),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "surrogate", None),
    ("/tokenize", {}, "prompt", "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt", "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "prompt"),
    ("/tokenize", {"prompt": "Hi", "model": 5}, "model", "model"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "yes"}, "add_special_tokens", "add_special_tokens"),
    ("/tokenize", {"prompt": "Hi", "return_token_strs": 1}, "return_token_strs", "return_token_strs"),
    ("/tokenize", {"messages": []}, "messages", "messages"),
    ("/tokenize", {"messages": "Hi"}, "messages", "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages", "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text", "messages"),
    ("/tokenize", {"messages": CHAT_MESSAGES[0], "continue_final_message": True}, "cannot both be true",
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT_MESSAGES[0], "chat_template": "{{ x }}"}, "chat_template", "chat_template"),
    ("/tokenize", {"messages": CHAT_MESSAGES[0], "tools": [{"type": "function"}]}, "tools", "tools"),
    ("/tokenize", {"messages": CHAT_MESSAGES[0], "add_generation_prompt": "no"}, "add_generation_prompt",
     "add_generation_prompt"),
    ("/detokenize", {}, "tokens", "tokens"),
    ("/detokenize", {"tokens": "Hi"}, "tokens", "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens", "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens", "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "outside the vocabulary", "tokens"),
    ("/detokenize", {"tokens": [1, 49152]}, "outside the vocabulary [0, 49152)", "tokens"),
    ("/detokenize", {"tokens": [2**70]}, "outside the vocabulary", "tokens"),
    ("/detokenize", b'{"tokens": [1], "model": "smollm2-135m", "x": NaN}', "finite", None),
]


@pytest.mark.parametrize("path, body, words, param", BAD, ids=range(len(BAD)))
def test_bad_input_is_a_400_in_the_error_shape(live_server, path, body, words, param):
    if isinstance(body, bytes):
        r = live_server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = live_server.post(path, json=body)
    error = assert_error(r, 400, words)
    assert error["param"] == param


def test_a_model_without_tokenizer_is_a_400():
    client = offline_app(None)
    assert_error(client.post("/tokenize", json={"prompt": "Hi"}), 400, "no tokenizer")
    assert_error(client.post("/detokenize", json={"tokens": [1]}), 400, "no tokenizer")


def test_openapi_schema_lists_both_routes_and_their_models(live_server):
    spec = httpx.get(live_server.base_url + "/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    routes = [("/tokenize", {"TokenizeCompletionRequest", "TokenizeChatRequest"}, "TokenizeResponse"),
              ("/detokenize", {"DetokenizeRequest"}, "DetokenizeResponse")]
    for path, requests, response in routes:
        op = spec["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        refs = {s["$ref"] for s in schema.get("anyOf", [schema])}
        assert refs == {f"#/components/schemas/{name}" for name in requests}
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response)
        assert requests | {response} <= set(schemas)
    fields = set(schemas["TokenizeCompletionRequest"]["properties"])
    assert {"prompt", "add_special_tokens", "return_token_strs"} <= fields
    assert schemas["TokenizeChatRequest"]["properties"]["messages"]["items"]["$ref"] == \
        "#/components/schemas/ChatMessage" and "ChatMessage" in schemas


def test_tokenizer_info_is_the_servers_tokenizer(live_server):
    """What lm-eval's remote tokenizer reads (tests/entrypoints/test_lm_eval.py runs it)."""
    url = live_server.base_url + "/tokenizer_info"
    assert_error(httpx.get(url, timeout=30), 401, "API key")
    info = httpx.get(url, headers=AUTH, timeout=30).json()
    tokenizer = live_server.loaded.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == live_server.engine.config.max_model_len
    assert info["vocab_size"] == live_server.engine.model_config.vocab_size
    eos = live_server.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [tokenizer.eos_token_id]
