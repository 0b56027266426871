"""Where each router's cache_aware policy sends prompts that match no replica (the reason
experiments/fleet_prefix_routing.py compares vllm-router with sglang-router 0.2.3).

Stub workers (in-process HTTP servers that answer at once and note which system prompt
each completion carried) stand in for replicas, so only the router's choice is measured.
16 distinct system prompts are sent one after another, then 48 requests that reuse them.
sglang-router 0.2.3 sends an unmatched prompt to the replica with the smallest prompt
tree, so the 16 prompts spread four to a replica; vllm-router sends it to the replica
with the fewest requests in flight, the first on a tie, and with one request at a time
that is always the same replica. Both keep every later request of a prompt on the
replica that saw it first. Needs the routers' venvs (experiments/setup_router.sh, run
here when missing: PyPI only): slow.
"""

import json
import os
import random
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from experiments.benchmarks.fleet_processes import wait_healthy
from experiments.serve_fleet import default_router_binary, router_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_WORKERS, NUM_PROMPTS = 4, 16


class _Stub(BaseHTTPRequestHandler):
    """/health, /v1/models, /tokenize (one id per word) and /v1/completions (noting the prompt's id);
    404 elsewhere."""

    def log_message(self, *args):
        pass

    def _reply(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            return self._reply({"object": "list", "data": [{"id": "smollm2-135m", "object": "model"}]})
        return self._reply({})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        text = body.get("prompt", "")
        if self.path.startswith("/tokenize"):
            tokens = [sum(map(ord, word)) for word in text.split()]
            return self._reply({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
        if self.path != "/v1/completions":  # e.g. vllm-router's /v1/completions/render: not served, as by ours
            self.send_error(404)
            return None
        self.server.seen.append(int(text.split(":")[0].split()[-1]))  # "System prompt <id>: ..."
        return self._reply({"id": "cmpl-stub", "object": "text_completion", "model": "smollm2-135m",
                            "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})


def _route(router: str, port: int) -> list[list[int]]:
    """Prompt ids each stub worker received, in order."""
    if not os.path.exists(default_router_binary(router)):
        subprocess.run(["bash", os.path.join(REPO, "experiments", "setup_router.sh"), router], check=True)
    servers = [ThreadingHTTPServer(("127.0.0.1", port + 1 + i), _Stub) for i in range(NUM_WORKERS)]
    for server in servers:
        server.seen = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{port + 1 + i}" for i in range(NUM_WORKERS)]
    argv = router_command(default_router_binary(router), port, "cache_aware", router=router,
                          prometheus_port=port + 100)(urls)
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 60, process, path="/v1/models")
        rng = random.Random(0)
        words = "system rules answer briefly politely accurately cite sources never reveal".split()
        prompts = [f"System prompt {p}: " + " ".join(rng.choice(words) for _ in range(300)) for p in range(NUM_PROMPTS)]
        order = list(range(NUM_PROMPTS)) + [rng.randrange(NUM_PROMPTS) for _ in range(48)]
        for i, p in enumerate(order):
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                  json={"model": "smollm2-135m", "prompt": f"{prompts[p]}\nQuestion {i}?", "max_tokens": 1})
            assert response.status_code == 200, response.text
    finally:
        process.terminate()
        process.wait(timeout=30)
        for server in servers:
            server.shutdown()
            server.server_close()
    assert sum(len(s.seen) for s in servers) == len(order)
    return [s.seen for s in servers]


def _owners(seen: list[list[int]]) -> dict[int, set[int]]:
    owners = {}
    for worker, prompts in enumerate(seen):
        for p in prompts:
            owners.setdefault(p, set()).add(worker)
    return owners


@pytest.mark.slow
def test_sglang_router_spreads_new_prompts_over_replicas():
    seen = _route("sglang", 18760)
    assert all(len(w) == 1 for w in _owners(seen).values()), seen  # a prompt stays where it went first
    assert sorted(len(set(prompts)) for prompts in seen) == [4, 4, 4, 4], seen


@pytest.mark.slow
def test_vllm_router_sends_every_new_prompt_to_one_idle_replica():
    seen = _route("vllm", 18780)
    assert all(len(w) == 1 for w in _owners(seen).values()), seen
    assert sorted(len(set(prompts)) for prompts in seen) == [0, 0, 0, NUM_PROMPTS], seen
