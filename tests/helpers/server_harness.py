"""A live OpenAI-compatible server on loopback for the server tests, and its offline truth.

One SmolLM2 engine with small buckets is built per test session. Before the server
starts (after that the engine belongs to the server's engine thread), the same engine
generates offline, greedily, every prompt the tests send, so a served answer can be
compared with `LLMEngine`'s own. uvicorn runs in a background thread on a free port
(paged_jax.entrypoints.openai.uvicorn_server).
"""

from __future__ import annotations

import dataclasses
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer

# layer_loop "scan": these tests are about the API, and SmolLM2's 30 layers unrolled (the
# CPU default, which the engine tests run) compile for several seconds longer per shape
SETTINGS = dict(block_size=16, num_blocks=160, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128,
                seq_buckets=(4, 16), token_buckets=(16, 64, 128), layer_loop="scan")
MODEL = "smollm2-135m"
API_KEY = "test-key"
MAX_BODY = 64 * 1024
MAX_WAITING = 256

COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                      "1, 2, 3, 4,"]
CHAT_MESSAGES = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "Name a colour."}]]
BEAM_COMPLETION = dict(beam_width=3, max_tokens=8, length_penalty=0.5)
BEAM_CHAT = dict(beam_width=2, max_tokens=10)
STOP_PROMPT, STOPS = "The capital of France is", (".", " answer")
_WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches "
          "under a pale moon near the old river bridge").split()


def load_prompts(n: int = 64) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs of mixed lengths: prompts ~5..40 tokens, outputs 1..16."""
    cases = []
    for i in range(n):
        words = [_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(1 + (i * 37) % 31)]
        cases.append((f"Request {i}: " + " ".join(words), 1 + (i * 5) % 16))
    return cases


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def run_offline(engine, requests: dict) -> dict:
    """requests: key -> (prompt, SamplingParams); returns key -> final RequestOutput."""
    for key, (prompt, params) in requests.items():
        engine.add_request(f"offline-{key}", prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id.removeprefix("offline-")] = out
    return finals


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    """An invalid-request error in OpenAI's shape, with `status` and each of `words` in its message."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    return error


def wait_until_healthy(proc, base_url: str, stderr_path, timeout: float = 300.0) -> None:
    """Poll a server subprocess's /health until 200 (its jax import and the buckets' compilation
    come first); fails with the process's stderr if it exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited early:\n{open(stderr_path).read()}"
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@dataclasses.dataclass
class LiveServer:
    loaded: object  # LoadedModel
    engine: object  # LLMEngine (owned by the server's engine thread while it runs)
    app: object
    uvicorn: BackgroundServer  # on 127.0.0.1:<free port>, in a daemon thread
    offline: dict  # key -> RequestOutput, generated before the server started

    @property
    def base_url(self) -> str:
        return self.uvicorn.base_url

    @property
    def loop(self):
        return self.app.state.engine_loop

    def openai(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def async_openai(self, **kwargs):
        from openai import AsyncOpenAI
        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def post(self, path: str, *, headers=None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
        return httpx.post(self.base_url + path, headers=headers, timeout=120, **kwargs)

    def metrics(self) -> dict:
        """{(sample name, sorted label items): value} from GET /metrics."""
        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the engine thread has no request and nothing is queued for it."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.loop.stats()
            if not (s["num_running"] or s["num_waiting"] or s.get("num_swapped", 0) or s["num_pending"]):
                time.sleep(0.05)  # one more publish after the last step
                s = self.loop.stats()
                if not (s["num_running"] or s["num_waiting"] or s["num_pending"]):
                    return
            assert time.monotonic() < deadline, f"server not idle after {timeout}s: {s}"
            time.sleep(0.02)

    def assert_all_blocks_free(self) -> None:
        self.wait_idle()
        bm = self.engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks, (bm.num_free_blocks, bm.num_usable_blocks)


def start_live_server() -> LiveServer:
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.loading import load_model
    from paged_jax.core.beam_search import BeamSearchParams
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.openai import ServerSettings, build_app

    loaded = load_model(MODEL)
    engine = LLMEngine(loaded, EngineConfig(**SETTINGS))
    greedy = SamplingParams(temperature=0, max_tokens=16)
    requests = {f"completion-{i}": (p, greedy) for i, p in enumerate(COMPLETION_PROMPTS)}
    requests.update({f"chat-{i}": ({"prompt_token_ids": chat_ids(loaded.tokenizer, m)}, greedy)
                     for i, m in enumerate(CHAT_MESSAGES)})
    requests["stop"] = (STOP_PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=STOPS))
    # echo / prompt logprobs: the prompt's logprobs with the top 3 (the echo tests compare with these)
    requests.update({f"prompt-logprobs-{i}": (p, SamplingParams(temperature=0, max_tokens=16, logprobs=3,
                                                                  prompt_logprobs=3))
                     for i, p in enumerate(COMPLETION_PROMPTS[:2])})
    requests.update({f"load-{i}": (p, SamplingParams(temperature=0, max_tokens=m))
                     for i, (p, m) in enumerate(load_prompts())})
    offline = run_offline(engine, requests)
    # beam search (use_beam_search), each alone as the server will run it: the engine's own beams, best first
    offline.update(run_offline(engine, {"beam-completion": (COMPLETION_PROMPTS[0], BeamSearchParams(**BEAM_COMPLETION))}))
    offline.update(run_offline(engine, {"beam-chat": ({"prompt_token_ids": chat_ids(loaded.tokenizer, CHAT_MESSAGES[0])},
                                                      BeamSearchParams(**BEAM_CHAT))}))
    app = build_app(engine, ServerSettings(served_model_name=MODEL, api_key=API_KEY,
                                           max_waiting_requests=MAX_WAITING, max_request_body_bytes=MAX_BODY))
    return LiveServer(loaded, engine, app, BackgroundServer(app), offline)
