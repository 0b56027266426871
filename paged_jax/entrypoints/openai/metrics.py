"""Prometheus metrics of one server: engine state at scrape time plus per-request figures.

Each app gets its own CollectorRegistry (never the process-global one), so tests and
notebooks can build several apps in one process without duplicate-metric errors.

Two kinds of figures:
  * engine state, read at scrape time from the engine loop's last published
    `engine.stats()` (running / waiting / swapped sequences, KV-cache usage, prefix-cache
    query and hit tokens, cached blocks, preemptions, steps). Stats keys an engine does
    not have yet read as 0;
  * per-request figures recorded by the HTTP handlers as outputs arrive (TTFT,
    inter-token latency, end-to-end latency, prompt and generation tokens, finished
    requests by finish reason, aborted and rejected requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from paged_jax.core.outputs import RequestOutput

PREFIX = "paged_jax"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REFUSAL_REASONS = ("bad_request", "model_not_found", "server_busy", "unavailable", "engine_dead")


class _EngineCollector(Collector):
    """Engine state at scrape time, from a callable returning the engine's stats dict."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for key, help_text in (("num_running", "sequences running (a request with n > 1 counts n)"),
                               ("num_waiting", "sequences waiting to be scheduled"),
                               ("num_swapped", "sequences swapped out to host memory"),
                               ("num_pending", "sequences submitted to the engine thread, not yet queued")):
            yield GaugeMetricFamily(f"{PREFIX}_{key.replace('num_', 'num_requests_')}", help_text,
                                    value=s.get(key, 0))
        total = s.get("num_blocks_total", 0)
        usage = 1.0 - s.get("num_blocks_free", 0) / total if total else 0.0
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_perc", "fraction of usable KV blocks in use (0..1)",
                                value=usage)
        yield GaugeMetricFamily(f"{PREFIX}_num_blocks_cached", "blocks held by the prefix cache",
                                value=s.get("num_blocks_cached", 0))
        for key, name, help_text in (
                ("prefix_cache_query_tokens", "prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hit_tokens", "prefix_cache_hits", "prompt tokens found in the prefix cache"),
                ("num_preemptions", "num_preemptions", "sequences preempted (recompute or swap)"),
                ("num_steps", "engine_steps", "engine steps run"),
                ("num_pool_check_failures", "kv_pool_check_failures",
                 "KV pool self-checks that found a leaked block, table or request (engine/pool_check.py)")):
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=s.get(key, 0) or 0)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between a request's successive outputs",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.step_requests = Histogram(f"{PREFIX}_step_requests", "requests that advanced in one engine step",
                                       buckets=STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "generated tokens", registry=r)
        self.request_success = Counter(f"{PREFIX}_request_success",
                                       "completions finished (each of n counts), by finish reason",
                                       ["finished_reason"], registry=r)
        for reason in ("stop", "length"):
            self.request_success.labels(reason)
        self.request_aborted = Counter(f"{PREFIX}_request_aborted",
                                       "requests aborted (client gone or server shutting down)", registry=r)
        self.request_rejected = Counter(f"{PREFIX}_request_rejected",
                                        "requests refused by a route (after the API key and size checks), by reason",
                                        ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.request_rejected.labels(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_step(self, outputs: list) -> None:
        """On the engine thread, after a step: `outputs` are its EngineCoreOutputs, one per request that moved."""
        self.step_requests.observe(len(outputs))

    def observe_refusal(self, error) -> None:
        """Count an APIError by its code (400s without one: bad_request); codes are a fixed set."""
        reason = error.code or ("bad_request" if error.status == 400 else str(error.status))
        self.request_rejected.labels(reason).inc()


class RequestRecorder:
    """Per-HTTP-request timing: `on_step` as each engine step's output of the request
    arrives (its stream calls it: the timing does not depend on how often the handler gets
    an output, once at the end for a whole answer), `on_output` with every RequestOutput
    the handler takes, then `finish` or `abort`."""

    def __init__(self, metrics: ServerMetrics, *, delta: bool = False):
        """`delta`: the handler's outputs are DELTA (a stream: tokens add up over outputs),
        else each holds the whole completion so far."""
        self.metrics = metrics
        self.start = time.monotonic()
        self._delta = delta
        self._last: float | None = None  # time of the last step that gave tokens
        self._tokens: dict[str, int] = {}  # engine request id -> tokens generated so far
        self._prompt_tokens: dict[str, int] = {}
        self._reasons: list[str] = []
        self._done = False

    def on_step(self) -> None:
        """One engine step gave one of the request's engine requests new tokens."""
        now = time.monotonic()
        if self._last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self._last)
        self._last = now

    def on_output(self, out: RequestOutput) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        self._prompt_tokens[out.request_id] = len(out.prompt_token_ids)
        self._tokens[out.request_id] = self._tokens.get(out.request_id, 0) + tokens if self._delta else tokens
        if out.finished:
            self._reasons.extend(c.finish_reason for c in out.outputs)

    def _count_tokens(self) -> None:
        self.metrics.prompt_tokens.inc(sum(self._prompt_tokens.values()))
        self.metrics.generation_tokens.inc(sum(self._tokens.values()))

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        self._count_tokens()
        self.metrics.e2e.observe(time.monotonic() - self.start)
        for reason in self._reasons:
            self.metrics.request_success.labels(reason).inc()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._count_tokens()
        self.metrics.request_aborted.inc()
