"""A local fleet: N serve_local replicas and a router, each its own process on loopback.

Why a process per replica: each replica is a whole engine (its own KV pool and prefix
cache), as on N machines; the router in front is an existing one (its command comes
from the caller: experiments/serve_fleet.py builds vllm-router's). `Fleet` starts the
replicas, waits until each answers /health, starts the router, and stops everything
cleanly (SIGTERM: replicas finish what they run within their --shutdown_timeout, then
exit; anything left after the grace is killed). `kill` and `restart` act on one
replica, for fault tests: the router's health checks must then stop and resume
sending to it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx


def replica_counters(url: str) -> dict:
    """A replica's prefix-cache and request counters from its /metrics: {"query", "hit",
    "success"} (prompt tokens looked up / found cached, requests finished)."""
    from prometheus_client.parser import text_string_to_metric_families
    names = {"paged_jax_prefix_cache_queries": "query", "paged_jax_prefix_cache_hits": "hit",
             "paged_jax_request_success": "success"}
    out = {v: 0.0 for v in names.values()}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name in names:
            out[names[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None, path: str = "/health") -> None:
    """Poll `url + path` until it answers 200; RuntimeError on timeout or if `process` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with status {process.returncode} before it was healthy")
        try:
            if httpx.get(url + path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}{path} did not answer 200 within {timeout_s:.0f} s")


class Fleet:
    def __init__(self, num_replicas: int, *, base_port: int = 8001, replica_args: list[str] = (),
                 router_command=None, router_port: int | None = None, log_dir: str | None = None,
                 host: str = "127.0.0.1", start_timeout_s: float = 600.0):
        """`replica_args`: extra serve_local flags for every replica; `router_command(urls)`
        -> argv of the router fronting those worker URLs on `router_port` (None: no router)."""
        self.host, self.ports = host, [base_port + i for i in range(num_replicas)]
        self.replica_args, self.router_command, self.router_port = list(replica_args), router_command, router_port
        self.log_dir, self.start_timeout_s = log_dir, start_timeout_s
        self.replicas: list[subprocess.Popen | None] = [None] * num_replicas
        self.router: subprocess.Popen | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    @property
    def router_url(self) -> str | None:
        return f"http://{self.host}:{self.router_port}" if self.router_port else None

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        out = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def start_replica(self, i: int) -> None:
        argv = [sys.executable, "-m", "experiments.serve_local", f"--host={self.host}", f"--port={self.ports[i]}",
                *self.replica_args]
        self.replicas[i] = self._spawn(argv, f"replica{i}")

    def start(self) -> Fleet:
        for i in range(len(self.ports)):  # all compile at once (one core each would be slower in turn)
            self.start_replica(i)
        for i, url in enumerate(self.urls):
            wait_healthy(url, self.start_timeout_s, self.replicas[i])
        if self.router_command is not None:
            self.router = self._spawn(self.router_command(self.urls), "router")
            wait_healthy(self.router_url, 120, self.router, path="/v1/models")
        return self

    def kill(self, i: int) -> None:
        """SIGKILL replica i (a crash: nothing finishes)."""
        process = self.replicas[i]
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)

    def restart(self, i: int) -> None:
        self.kill(i)
        self.start_replica(i)
        wait_healthy(self.urls[i], self.start_timeout_s, self.replicas[i])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the router, then every replica; SIGKILL whatever outlives the grace."""
        processes = [p for p in [self.router, *self.replicas] if p is not None and p.poll() is None]
        for p in processes:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in processes:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
