"""A failed engine step never leaves a server that looks healthy and serves nothing.

The behaviour a supervisor relies on (engine_loop.py, uvicorn_server.py, serve.py): the
requests in flight get an error in OpenAI's shape (whole: a 500; streamed: an error
event, then [DONE]), new requests and /health get 503, the server shuts itself down,
and the entry point exits with status 1. Each server here is built on the tiny
random-weight Llama (token-id prompts, no tokenizer), never on the shared SmolLM2
`live_server`, because its engine dies.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
from tests.helpers.server_harness import wait_until_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "tiny"
TINY = dict(block_size=16, num_blocks=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
            seq_buckets=(4,), token_buckets=(32,))
LONG = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=240, ignore_eos=True, temperature=0,
            return_token_ids=True)  # no tokenizer, so no text: the ids make every step send a chunk


class InjectedFault(RuntimeError):
    pass


def arm_fault(engine) -> None:
    """The runner raises inside the first step that batches two sequences (a device fault
    after the scheduler already scheduled the step, as a real one would). Steps take at
    least 20 ms meanwhile, so a long request is still running when a second one comes."""
    execute = engine.runner.execute

    def execute_or_fail(output, seqs):
        if len(output.chunks) >= 2:
            raise InjectedFault("injected device fault")
        time.sleep(0.02)
        return execute(output, seqs)

    engine.runner.execute = execute_or_fail


def assert_engine_dead(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "engine_dead"
    assert "injected device fault" in error["message"], error


async def fail_mid_flight(server: BackgroundServer):
    """A stream (that sent a token already) and a whole request both running when the
    step fails; returns the whole response and the stream's events."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        request = client.build_request("POST", "/v1/completions", json=dict(LONG, stream=True))
        stream = await client.send(request, stream=True)
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        events = [await anext(lines)]  # the first token: it is running
        assert '"token_ids":' in events[0], events
        whole = await client.post("/v1/completions", json=LONG)  # the step that batches both fails
        events += [line async for line in lines]
        await stream.aclose()
        return whole, [e for e in events if e]


def test_in_flight_requests_get_errors_then_503s_and_the_server_shuts_down(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(**TINY))
    arm_fault(engine)
    server = BackgroundServer(build_app(engine, ServerSettings(served_model_name=MODEL)), grace=0.5)
    loop = server.loop
    try:
        assert loop.on_failure == server.server.engine_failed  # the server's exit path is wired in
        exit_requested, release = threading.Event(), threading.Event()

        def hold_then_exit(exc):  # on the engine thread: keep the port open while the dead server is probed
            exit_requested.set()
            release.wait(60)
            server.server.engine_failed(exc)

        loop.on_failure = hold_then_exit
        assert httpx.get(server.base_url + "/health").status_code == 200
        whole, events = asyncio.run(fail_mid_flight(server))

        assert whole.status_code == 500, whole.text
        assert_engine_dead(whole.json()["error"])
        assert events[-1] == "data: [DONE]"
        assert_engine_dead(json.loads(events[-2].removeprefix("data: "))["error"])
        assert not any('"finish_reason":"length"' in e for e in events)  # cut short, not finished

        assert exit_requested.wait(30), "the engine loop did not report its failure"
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        assert "injected device fault" in health.json()["error"]
        for body in (LONG, dict(LONG, stream=True)):  # refused before anything is queued or streamed
            r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503, r.text
            assert_engine_dead(r.json()["error"])
        assert server.thread.is_alive() and not server.server.should_exit
        release.set()
        server.thread.join(30)
        assert not server.thread.is_alive(), "the server did not shut down after the engine failed"
        assert isinstance(server.engine_error, InjectedFault)
        assert not loop._thread.is_alive()
    finally:
        release.set()
        server.stop(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The console script's own code path (cli.main -> serve_from_flags -> uvicorn) with two
# stand-ins: `--model=tiny` loads the tiny random-weight Llama, and every step raises.
SERVE_TINY_AND_FAIL = """
import sys
import jax
import configs
from paged_jax.engine import engine_core as core, llm_engine
from paged_jax.loading import LoadedModel
from paged_jax.model.llama import init_params

cfg = configs.get_config("tiny_llama")
tiny = LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, "memory", "memory", 0.0)
llm_engine.load_model = lambda name, dtype=None: tiny

def step(self):
    raise RuntimeError("injected fault in engine.step")

core.EngineCore.step = step
from paged_jax.entrypoints import cli
sys.exit(cli.main(["paged-jax", "serve", *sys.argv[1:]]))
"""


def test_the_process_exits_with_status_1_after_an_engine_failure(tmp_path):
    port = _free_port()
    flags = [f"--model={MODEL}", f"--port={port}", "--log_level=warning", "--shutdown_timeout=0.5",
             "--block_size=16", "--num_blocks=64", "--max_model_len=256", "--max_num_seqs=4",
             "--max_num_batched_tokens=32", "--seq_buckets=4", "--token_buckets=32"]
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVE_TINY_AND_FAIL, *flags], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_until_healthy(proc, base, tmp_path / "stderr")
            r = httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=4), timeout=60)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
            status = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "stderr").read_text()
    assert status == 1, log
    assert "Traceback" in log and "injected fault in engine.step" in log, log  # the engine's exception, logged
