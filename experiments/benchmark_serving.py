"""Load test of the OpenAI-compatible server: `python -m experiments.benchmark_serving`.

Sends --num_requests streamed /v1/completions requests (token-id prompts from
experiments/benchmarks/workloads.py, `ignore_eos` so every output has its drawn length) over
loopback with async httpx, arriving as a Poisson process at --request_rate (inf: all at
once), at most --max_concurrency in flight. Per request it records the time to the
first token (TTFT), the time per output token after it (TPOT), end-to-end latency and
output tokens (counted from the token ids each chunk carries); it writes their
p50/p90/p99, request and output-token throughput and the wall time to
experiments/results/serving_load.json.

Without --base_url it starts the server in this process on a free port, with the
engine built from the same flags as serve_local (every EngineConfig field).

--compare_offline (in-process server only): each of --rounds rounds serves the trace
offline first (the same engine, token ids in, greedy, final outputs only: what
`LLM.generate` does) and then through the server, A B A B, and the record adds the offline
output tok/s and the server's share of it. Why: the server's event loop (HTTP, JSON,
detokenization, streaming) and the engine's thread share one interpreter lock, so a
saturated server can serve fewer tokens than the engine alone produces; vLLM moved its
engine core into a process of its own for this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time

import numpy as np
from absl import app, flags

from paged_jax.entrypoints import engine_flags
from experiments.benchmarks.workloads import DATASETS, make_trace
from paged_jax.entrypoints.engine_flags import define_engine_flags, engine_config_from_flags
from experiments.reporting.results_io import write_result
from paged_jax.config.engine_config import EngineConfig

_BASE_URL = flags.DEFINE_string("base_url", None, "A running server (http://host:port); default: start one here.")
_API_KEY = flags.DEFINE_string("api_key", None, "Bearer key for a server started with --api_key.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model of the in-process server.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 500, "Requests to send.")
_RATE = flags.DEFINE_float("request_rate", float("inf"), "Poisson arrival rate (requests/s); inf: all at t=0.")
_MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", None, "Requests in flight at most (default: no limit).")
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", sorted(DATASETS), "Length statistics of prompts and outputs.")
_SCALE = flags.DEFINE_float("scale", 1.0, "Multiplies both mean lengths (CPU runs: e.g. 0.1).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Cap on each request's output length.")
_VOCAB = flags.DEFINE_integer("vocab_size", None, "Prompt token ids are drawn below it (default: the model's).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the trace and the engine.")
_OUTPUT = flags.DEFINE_string("output", "experiments/results/serving_load.json", "Where the JSON record goes.")
_COMPARE = flags.DEFINE_bool("compare_offline", False, "Also serve the trace offline on the same engine, A B A B.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "With --compare_offline: rounds of (offline, server).")
define_engine_flags(skip=("seed",))
flags.adopt_module_key_flags(engine_flags)


@dataclasses.dataclass
class Record:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def _one(client, model: str, request, semaphore, bar) -> Record:
    body = {"model": model, "prompt": list(request.prompt_token_ids), "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    record = Record(ok=False, prompt_tokens=len(request.prompt_token_ids))
    async with semaphore:
        start = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    record.error = f"{response.status_code}: {(await response.aread()).decode()[:200]}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record.error = chunk["error"]["message"]
                        return record
                    new = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                    if new and record.ttft is None:
                        record.ttft = time.perf_counter() - start
                    record.output_tokens += new
            record.e2e = time.perf_counter() - start
            record.ok = record.ttft is not None
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            bar.update(1)
    return record


async def _run(base_url: str, model: str, trace, headers: dict) -> tuple[list[Record], float]:
    from tqdm.auto import tqdm
    import httpx

    limit = _MAX_CONCURRENCY.value or len(trace)
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit + 8, max_keepalive_connections=limit + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        with tqdm(total=len(trace), desc="requests") as bar:
            start = time.perf_counter()
            tasks = []
            for request in trace:
                delay = request.arrival_time - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(client, model, request, semaphore, bar)))
            records = await asyncio.gather(*tasks)
            wall = time.perf_counter() - start
    return records, wall


def _percentiles(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    a = np.asarray(values) * 1000.0
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99))}


def _server_info(base_url: str, headers: dict) -> tuple[str, int]:
    import httpx
    card = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    return card["id"], int(card.get("max_model_len", 2048))


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    headers = {"Authorization": f"Bearer {_API_KEY.value}"} if _API_KEY.value else {}
    server, engine = None, None
    if _COMPARE.value and _BASE_URL.value:
        raise app.UsageError("--compare_offline needs the in-process server (no --base_url)")
    if _BASE_URL.value:
        base_url = _BASE_URL.value.rstrip("/")
    else:
        from paged_jax.worker.compilation_cache import enable_compilation_cache
        from paged_jax.engine.llm_engine import LLMEngine
        from paged_jax.entrypoints.allocators import make_allocator
        from paged_jax.entrypoints.openai import ServerSettings, build_app
        from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer

        enable_compilation_cache()
        # the record holds kv_utilization (a paper figure); --kv_allocator may name a baseline
        engine = LLMEngine(_MODEL.value, engine_config_from_flags(seed=_SEED.value, paper_metrics=True),
                           allocator_factory=make_allocator)
        # the bound on waiting requests must not refuse the benchmark's own burst
        settings = ServerSettings(served_model_name=_MODEL.value, max_waiting_requests=10 * _NUM_REQUESTS.value)
        serve = lambda: BackgroundServer(build_app(engine, settings))  # noqa: E731
        server = serve()
        base_url = server.base_url
    offline_rounds, server_rounds = [], []
    try:
        model, max_model_len = _server_info(base_url, headers)
        vocab = _VOCAB.value or (engine.model_config.vocab_size if engine is not None else 49152)
        rate = None if math.isinf(_RATE.value) else _RATE.value
        trace = make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value,
                           max_model_len=max_model_len, vocab_size=vocab, request_rate=rate)
        if _MAX_TOKENS.value:
            trace = [dataclasses.replace(r, max_tokens=min(r.max_tokens, _MAX_TOKENS.value)) for r in trace]
        for round_index in range(_ROUNDS.value if _COMPARE.value else 1):
            if _COMPARE.value:
                server.stop()  # the offline run has the engine to itself; a fresh server after it
                offline_rounds.append(_offline(engine, trace))
                engine.core.reset_prefix_cache()
                server = serve()
                base_url = server.base_url
            records, wall = asyncio.run(_run(base_url, model, trace, headers))
            server_rounds.append(sum(r.output_tokens for r in records if r.ok) / wall)
            if _COMPARE.value:
                engine.core.reset_prefix_cache()
        engine_stats = server.loop.stats() if server is not None else None
    finally:
        if server is not None:
            server.stop()
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    figures = {
        "num_requests": len(records), "num_completed": len(done), "num_failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_seconds": wall,
        "request_throughput": len(done) / wall, "output_token_throughput": output_tokens / wall,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / wall,
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in records])),
        "mean_output_tokens": output_tokens / max(len(done), 1),
        "ttft": _percentiles(r.ttft for r in done), "tpot": _percentiles(r.tpot for r in done),
        "e2e": _percentiles(r.e2e for r in done),
        "expected_output_tokens": sum(r.max_tokens for r in trace),
    }
    if offline_rounds:  # A B A B: each side's best round (other work only slows a round down)
        figures["offline_output_token_throughput_per_round"] = offline_rounds
        figures["server_output_token_throughput_per_round"] = server_rounds
        figures["offline_output_token_throughput"] = max(offline_rounds)
        figures["server_vs_offline"] = max(server_rounds) / max(offline_rounds)
    if engine is not None:
        figures["engine_config"] = {k: v for k, v in dataclasses.asdict(engine.config).items()}
        figures["engine"] = {k: engine_stats.get(k) for k in ("num_preemptions", "kv_utilization", "mean_batched_seqs",
                                                             "max_batched_seqs", "num_compilations_after_warm_up",
                                                             "prefix_cache_hit_tokens", "prefix_cache_query_tokens")}
    output = os.path.abspath(_OUTPUT.value)
    path = write_result(os.path.basename(output).removesuffix(".json"), seed=_SEED.value,
                        results_dir=os.path.dirname(output),
                        flags=_flag_values(), figures=figures)
    print(json.dumps({k: figures[k] for k in ("num_completed", "wall_seconds", "request_throughput",
                                              "output_token_throughput", "ttft", "tpot")}, indent=1))
    print(f"wrote {path}")


def _offline(engine, trace) -> float:
    """The trace through the engine without the server (all requests at once, greedy, the
    engine's own step loop, final outputs only); output tokens per second."""
    from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams

    start = time.perf_counter()
    for i, request in enumerate(trace):
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=request.max_tokens,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"offline-{i}", {"prompt_token_ids": list(request.prompt_token_ids)}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
    return tokens / (time.perf_counter() - start)


def _flag_values() -> dict:
    names = ["base_url", "model", "num_requests", "request_rate", "max_concurrency", "workload", "scale",
             "max_tokens", "vocab_size", "seed", "compare_offline", "rounds"] + [f.name for f in dataclasses.fields(EngineConfig)
                                                     if f.name in flags.FLAGS]
    values = {name: flags.FLAGS[name].value for name in names}
    return {k: (str(v) if isinstance(v, float) and math.isinf(v) else list(v) if isinstance(v, tuple) else v)
            for k, v in values.items()}


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
