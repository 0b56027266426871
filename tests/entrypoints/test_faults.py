"""Injected faults against a live server: a client that stops reading, a request flood,
SIGTERM under load. Each server runs the tiny random-weight Llama (token-id prompts, no
tokenizer) with its steps slowed down by a fixed sleep, so that requests are still running
when the fault comes and the timings do not depend on how fast these cores are.

(A step that raises: test_engine_failure.py.)
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.openai import ServerSettings, build_app
from paged_jax.entrypoints.openai.uvicorn_server import SHUTDOWN_MESSAGE, BackgroundServer
from tests.helpers.server_harness import wait_until_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "tiny"
CONFIG = dict(block_size=16, num_blocks=160, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32,
              seq_buckets=(4,), token_buckets=(32,))
PROMPT = [5, 6, 7, 8]


def body(max_tokens: int, **fields) -> dict:
    return dict(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0,
                return_token_ids=True, **fields)


def slow_steps(engine, seconds: float) -> None:
    """Every step takes at least `seconds` longer (the runner sleeps before it runs)."""
    execute = engine.runner.execute

    def slow_execute(output, seqs):
        time.sleep(seconds)
        return execute(output, seqs)

    engine.runner.execute = slow_execute


def tiny_server(tiny_llama, *, step_seconds: float, max_waiting_requests: int = 256, **config):
    engine = LLMEngine(tiny_llama, EngineConfig(**dict(CONFIG, **config)))
    slow_steps(engine, step_seconds)
    settings = ServerSettings(served_model_name=MODEL, max_waiting_requests=max_waiting_requests)
    return engine, BackgroundServer(build_app(engine, settings), grace=0.5)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_error(error: dict, code: str) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "server_error" and error["code"] == code and error["message"], error


def assert_idle_and_clean(engine, server) -> None:
    wait_for(lambda: not server.loop.has_requests() and server.loop.stats()["num_pending"] == 0, 30, "an idle loop")
    wait_for(lambda: not engine.has_unfinished_requests(), 30, "an idle engine")
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, (bm.num_free_blocks, bm.num_usable_blocks)


# ---- a client that stops reading -----------------------------------------------------------
def capture_streams(loop) -> list:
    """Every RequestStream the server's handlers get from `loop.submit`, in order."""
    streams, submit = [], loop.submit

    def recording_submit(requests, **kwargs):
        stream = submit(requests, **kwargs)
        streams.append(stream)
        return stream

    loop.submit = recording_submit
    return streams


def open_stalled_stream(server, request: dict, *, read_first_event: bool) -> socket.socket:
    """A raw HTTP/1.1 stream with a tiny receive buffer that (after its first event, or
    at once) is never read again: the kernel's buffers fill and the server's send blocks."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: the window stays small
    sock.connect((server.host, server.port))
    payload = json.dumps(request).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    if read_first_event:
        got = b""
        while b'"token_ids"' not in got:
            chunk = sock.recv(256)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got
    return sock


def timed_completion(server, max_tokens: int = 16) -> float:
    start = time.monotonic()
    r = httpx.post(server.base_url + "/v1/completions", json=body(max_tokens), timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == max_tokens, r.text
    return time.monotonic() - start


def test_a_client_that_stops_reading_holds_back_nothing_but_itself(tiny_llama):
    """Two streams stop reading (one at once, one after its first event) while the engine
    goes on generating for them: each keeps at most one pending output however far it
    falls behind, other requests complete as fast as before, and closing the socket
    aborts its request in the engine (freeing its blocks) before it ran to max_tokens."""
    max_tokens = 500
    engine, server = tiny_server(tiny_llama, step_seconds=0.01)
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    streams = capture_streams(server.loop)
    sockets = []
    try:
        baseline = max(timed_completion(server) for _ in range(3))
        stalled = dict(body(max_tokens, stream=True, logprobs=5))  # ~600-byte events fill buffers fast
        for read_first_event in (False, True):
            sockets.append(open_stalled_stream(server, stalled, read_first_event=read_first_event))
        never, one = streams[-2:]
        # far beyond what the socket buffers and uvicorn's 64 KiB write buffer hold (~150 events)
        wait_for(lambda: min(never.num_received, one.num_received) >= 250, 60, "the stalled streams' outputs")
        assert never.num_pending <= 1 and one.num_pending <= 1, (never.num_pending, one.num_pending)

        during = [timed_completion(server) for _ in range(3)]
        # the engine was not held back: a held-back engine slows every request, so the median
        # decides (one of three can meet a first compile of a 3-row shape on a cold cache)
        assert sorted(during)[1] < 3 * baseline + 1.0, (baseline, during)
        assert never.num_pending <= 1 and one.num_pending <= 1, (never.num_pending, one.num_pending)
        wait_for(lambda: server.loop.stats()["num_running"] == 2, 5, "only the stalled requests running "
                 "(if they finished already, they finished too early to test aborts)")

        sockets[0].close()  # the client goes away: its request is aborted mid-generation
        wait_for(lambda: server.loop.stats()["num_running"] == 1, 10, "the first stalled request's abort")
        assert never.aborted and never.num_received < max_tokens
        sockets[1].close()
        wait_for(lambda: server.loop.stats()["num_running"] == 0, 10, "the second stalled request's abort")
        assert one.aborted and one.num_received < max_tokens
        assert_idle_and_clean(engine, server)
        assert timed_completion(server) < 3 * baseline + 1.0
    finally:
        for sock in sockets:
            sock.close()
        server.stop(30)


# ---- a request flood past --max_waiting_requests -----------------------------------------------
async def _flood(base_url: str, num_clients: int, max_tokens: int) -> list[tuple[bool, list, list]]:
    """`num_clients` clients at once, half of them streaming, each retrying after a 503
    (as an OpenAI client does) until it is served; per client (streamed, the token ids it
    got, the error bodies of its refusals)."""
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def attempt(streamed: bool):
            request = client.build_request("POST", "/v1/completions", json=body(max_tokens, stream=streamed))
            response = await client.send(request, stream=True)
            try:
                if response.status_code != 200:
                    return response.status_code, json.loads(await response.aread())
                if not streamed:
                    choice = json.loads(await response.aread())["choices"][0]
                    assert choice["finish_reason"] == "length", choice
                    return 200, choice["token_ids"]
                events = [line async for line in response.aiter_lines() if line]
                assert events[-1] == "data: [DONE]", events[-3:]
                chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
                assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
                return 200, [t for c in chunks for t in c["choices"][0]["token_ids"] or []]
            finally:
                await response.aclose()

        async def one(i: int):
            streamed, refusals = i % 2 == 1, []
            while True:
                status, got = await attempt(streamed)
                if status == 200:
                    return streamed, got, refusals
                refusals.append((status, got))
                assert len(refusals) < 500, refusals[-1]
                await asyncio.sleep(0.05)

        return await asyncio.gather(*(one(i) for i in range(num_clients)))


def test_a_flood_past_the_waiting_bound_loses_nothing_it_accepted(tiny_llama):
    """16 clients at once, retrying on 503, against 2 running slots and a waiting bound of
    3: every request accepted completes with every token (the same greedy tokens as
    alone), every refusal is a 503 server_busy in OpenAI's error shape (a stream's comes
    before any event), and afterwards the admission count is back to 0 and every block
    is free."""
    num_clients, max_tokens = 16, 24
    engine, server = tiny_server(tiny_llama, step_seconds=0.01, max_waiting_requests=3, max_num_seqs=2,
                                 seq_buckets=(2,))
    try:
        alone = httpx.post(server.base_url + "/v1/completions", json=body(max_tokens), timeout=60)
        want = alone.json()["choices"][0]["token_ids"]
        assert len(want) == max_tokens
        results = asyncio.run(_flood(server.base_url, num_clients, max_tokens))
        refusals = [r for _, _, client_refusals in results for r in client_refusals]
        assert len(refusals) >= num_clients - 5, len(refusals)  # at most 2 running + 3 waiting got in at first
        for _, token_ids, _ in results:
            assert token_ids == want
        for status, error in refusals:
            assert status == 503, error
            assert_error(error["error"], "server_busy")
            assert "waiting queue is full" in error["error"]["message"]
        assert_idle_and_clean(engine, server)
        metrics = httpx.get(server.base_url + "/metrics").text
        assert f'paged_jax_request_rejected_total{{reason="server_busy"}} {float(len(refusals))}' in metrics
        assert f'paged_jax_request_success_total{{finished_reason="length"}} {float(num_clients + 1)}' in metrics
        assert httpx.post(server.base_url + "/v1/completions", json=body(4), timeout=60).status_code == 200
    finally:
        server.stop(30)


# ---- SIGTERM under load ------------------------------------------------------------------------
# The console script's own path (cli.main -> serve_from_flags -> uvicorn) with two stand-ins:
# `--model=tiny` loads the tiny random-weight Llama, and every step sleeps 20 ms first.
SERVE_TINY_SLOWLY = """
import sys, time
import jax
import configs
from paged_jax.engine import engine_core as core, llm_engine
from paged_jax.loading import LoadedModel
from paged_jax.model.llama import init_params

cfg = configs.get_config("tiny_llama")
tiny = LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, "memory", "memory", 0.0)
llm_engine.load_model = lambda name, dtype=None: tiny
step = core.EngineCore.step

def slow_step(self):
    time.sleep(0.02)
    return step(self)

core.EngineCore.step = slow_step
from paged_jax.entrypoints import cli
sys.exit(cli.main(["paged-jax", "serve", *sys.argv[1:]]))
"""
GRACE = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


async def _load_then_sigterm(base: str, proc, port: int) -> dict:
    """Long requests (480 tokens: ~10 s) and medium ones (40 tokens: under a second), all
    running, then SIGTERM. Returns what each client got, how long after the signal the
    last one returned, and whether a new connection was refused during the grace period."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async def stream(max_tokens: int, opened: asyncio.Event):
            async with client.stream("POST", "/v1/completions", json=body(max_tokens, stream=True)) as r:
                assert r.status_code == 200
                events = []
                async for line in r.aiter_lines():
                    if line:
                        events.append(line)
                        opened.set()  # its first token: it is running
                return ("stream", max_tokens, events)

        async def whole(max_tokens: int):
            r = await client.post("/v1/completions", json=body(max_tokens))
            return ("whole", max_tokens, r)

        async def running() -> int:
            text = (await client.get("/metrics")).text
            return int(float(next(line.split()[-1] for line in text.splitlines()
                                  if line.startswith("paged_jax_num_requests_running "))))

        opened = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(stream(480, opened[i])) for i in range(3)]
        tasks += [asyncio.create_task(whole(480)) for _ in range(3)]
        tasks += [asyncio.create_task(stream(40, opened[3])), asyncio.create_task(whole(40))]
        for event in opened:
            await asyncio.wait_for(event.wait(), 60)
        deadline = time.monotonic() + 30
        while await running() < 8:
            assert time.monotonic() < deadline, "the 8 requests did not all run at once"
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.5)
        refused_during_grace = await asyncio.to_thread(_refused, port)
        assert proc.poll() is None, "the server exited before the grace period was over"
        done, pending = await asyncio.wait(tasks, timeout=GRACE + 15)
        returned_after = time.monotonic() - signalled
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} clients did not return within {GRACE + 15} s of SIGTERM"
        return dict(results=[t.result() for t in tasks], returned_after=returned_after,
                    refused_during_grace=refused_during_grace)


def _assert_finished_or_told(kind: str, max_tokens: int, got) -> bool:
    """True if the request finished normally, False if it was told it was aborted."""
    if kind == "stream":
        assert got[-1] == "data: [DONE]", got[-3:]
        last = json.loads(got[-2].removeprefix("data: "))
        if "error" in last:
            assert_error(last["error"], "unavailable")
            assert last["error"]["message"] == SHUTDOWN_MESSAGE
            return False
        assert last["choices"][0]["finish_reason"] == "length", last
        tokens = [t for e in got[:-1] for t in json.loads(e.removeprefix("data: "))["choices"][0]["token_ids"] or []]
        assert len(tokens) == max_tokens
        return True
    if got.status_code == 503:
        assert_error(got.json()["error"], "unavailable")
        return False
    assert got.status_code == 200, got.text
    assert len(got.json()["choices"][0]["token_ids"]) == max_tokens
    return True


def test_sigterm_under_load_finishes_or_aborts_every_request_then_exits_0(tmp_path):
    """SIGTERM with 8 requests running: the port closes at once (new connections are
    refused), the medium requests finish within the grace period, the long ones are then
    aborted and told so (a stream: an error event and [DONE]; a whole response: a 503),
    every client returns within a bound, and the process exits 0."""
    port = _free_port()
    flags = [f"--model={MODEL}", f"--port={port}", "--log_level=warning", f"--shutdown_timeout={GRACE}",
             "--block_size=16", "--num_blocks=320", "--max_model_len=512", "--max_num_seqs=8",
             "--max_num_batched_tokens=32", "--seq_buckets=8", "--token_buckets=32"]
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", SERVE_TINY_SLOWLY, *flags], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_until_healthy(proc, base, tmp_path / "stderr")
            outcome = asyncio.run(_load_then_sigterm(base, proc, port))
            status = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "stderr").read_text()
    assert status == 0, log
    assert "server stopped" in log and "Traceback" not in log, log
    assert outcome["refused_during_grace"], "the port still accepted connections after SIGTERM"
    finished = [_assert_finished_or_told(kind, n, got) for kind, n, got in outcome["results"]]
    assert finished == [False] * 6 + [True] * 2, finished  # long ones aborted, medium ones finished
    assert GRACE - 0.5 < outcome["returned_after"] < GRACE + 5, outcome["returned_after"]
    assert _refused(port)

