"""Prefix-aware routing vs round-robin on a real local fleet (replicas behind a router).

    bash experiments/setup_router.sh && python -m experiments.fleet_prefix_routing
    python -m experiments.fleet_prefix_routing --num_replicas=2 --num_requests=16 --prefix_words=200
    bash experiments/setup_router.sh sglang && python -m experiments.fleet_prefix_routing \
        --run=round_robin --run=cache_aware --run=sglang:cache_aware

Why: a replica's prefix cache only helps the requests that reach it; round-robin spreads
every system prompt over every replica (each computes each prompt's prefill, and with
more prompts than one replica's KV holds, evicts them again), while a cache-aware router
keeps a prompt's requests on the replica that cached it. This runs the same trace through
a fresh fleet per policy (experiments/serve_fleet.py: --num_replicas serve_local
processes, vllm-router or sglang-router in front): --num_prefixes distinct system prompts of
--prefix_words words (~1.2 tokens each), each request one of them (uniformly) plus a
short question, Poisson arrivals at --request_rate, streamed, greedy, --max_tokens
tokens. Recorded per policy: the fleet's prefix-cache hit rate (the replicas' own
/metrics counters: hit / looked-up prompt tokens), TTFT p50 / p90 as the client sees it
(to the first streamed token), requests per replica and their largest deviation from
the mean, and failures. On this 2-core machine the replicas share the cores, so absolute
times are slow; the comparison is between policies on the same machine.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
from absl import app, flags

from experiments.benchmarks.fleet_processes import replica_counters
from experiments.serve_fleet import ROUTER_VERSIONS, ROUTERS, check_plan, make_fleet, parse_run

_WORDS = ("system rules answer briefly politely accurately cite sources never reveal secrets prefer metric units "
          "explain steps check arithmetic refuse unsafe requests summarize documents translate kindly format tables "
          "use markdown keep context remember names avoid jargon").split()

_NUM_REPLICAS = flags.DEFINE_integer("num_replicas", 4, "Replicas behind the router.")
_ROUTER = flags.DEFINE_enum("router", "vllm", list(ROUTERS), "The router of a run that names none.")
_POLICIES = flags.DEFINE_list("policies", ["round_robin", "cache_aware"], "Router policies to compare.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests per policy (the same trace each time).")
_NUM_PREFIXES = flags.DEFINE_integer("num_prefixes", 16, "Distinct system prompts.")
_PREFIX_WORDS = flags.DEFINE_integer("prefix_words", 800, "Words per system prompt (~1,000 tokens at 800).")
_RATE = flags.DEFINE_float("request_rate", 0.5, "Poisson arrivals per second.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens per answer (ignore_eos).")
_REPLICA_FLAGS = flags.DEFINE_string("replica_flags", "--max_num_seqs=16 --max_num_batched_tokens=256",
                                     "serve_local flags of every replica.")
_ROUTER_FLAGS = flags.DEFINE_string("router_flags", "", "Extra router flags, e.g. '--balance-abs-threshold 2 "
                                                     "--balance-rel-threshold 1.5' (cache_aware's load balance).")
_RUNS = flags.DEFINE_multi_string(
    "run", [], "One fleet run per value, '[ROUTER:]POLICY [router flags]' (ROUTER vllm or sglang, default "
    "--router), e.g. --run=round_robin '--run=cache_aware --balance-abs-threshold 2' --run=sglang:cache_aware: "
    "policies, routers and router settings in one comparison. Given, it replaces --policies and --router_flags.")
_PORT = flags.DEFINE_integer("port", 18600, "Router port; replicas on port + 1 ...")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_OUTPUT = flags.DEFINE_string("output", "fleet_prefix_routing", "Result name: experiments/results/<output>.json.")


def make_trace(num_requests: int, num_prefixes: int, prefix_words: int, rate: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    prefixes = [f"System prompt {p}: " + " ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), prefix_words))
                for p in range(num_prefixes)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    which = rng.integers(0, num_prefixes, num_requests)
    return [{"prefix": int(w), "arrival": float(a),
             "prompt": f"{prefixes[w]}\nQuestion {i}: " + " ".join(_WORDS[j] for j in rng.integers(0, len(_WORDS), 8))}
            for i, (a, w) in enumerate(zip(arrivals, which))]


async def _one(client, url: str, item: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    body = {"model": "smollm2-135m", "prompt": item["prompt"], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                return {"error": response.status_code}
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    first = time.perf_counter()
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "latency_s": end - start}


async def replay(url: str, trace: list[dict], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()

        async def at(item):
            await asyncio.sleep(max(0.0, start + item["arrival"] - time.perf_counter()))
            return await _one(client, url, item, max_tokens)
        return await asyncio.gather(*(at(item) for item in trace))


def run_policy(policy: str, trace: list[dict], router_flags: str, log_dir: str, router: str = "vllm") -> dict:
    import shlex
    fleet = make_fleet(_NUM_REPLICAS.value, policy=policy, port=_PORT.value, base_port=_PORT.value + 1,
                       replica_args=shlex.split(_REPLICA_FLAGS.value), log_dir=log_dir,
                       router_args=shlex.split(router_flags), router=router)
    with fleet:
        for url in fleet.urls:  # one throwaway request per replica: first-request costs out of the timings
            httpx.post(url + "/v1/completions", json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2},
                       timeout=120)
        before = [replica_counters(u) for u in fleet.urls]
        start = time.perf_counter()
        results = asyncio.run(replay(fleet.router_url, trace, _MAX_TOKENS.value))
        wall = time.perf_counter() - start
        after = [replica_counters(u) for u in fleet.urls]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    ok = [r for r in results if "error" not in r]
    counts = [int(d["success"]) for d in delta]
    query, hit = sum(d["query"] for d in delta), sum(d["hit"] for d in delta)
    mean = float(np.mean(counts))
    return {"policy": policy, "router": ROUTER_VERSIONS[router], "router_flags": router_flags, "num_ok": len(ok),
            "errors": [r["error"] for r in results if "error" in r],
            "prefix_cache_hit_rate": hit / query if query else 0.0, "prefix_cache_query_tokens": query,
            "ttft_s_p50": float(np.percentile([r["ttft_s"] for r in ok], 50)),
            "ttft_s_p90": float(np.percentile([r["ttft_s"] for r in ok], 90)),
            "latency_s_p50": float(np.percentile([r["latency_s"] for r in ok], 50)),
            "requests_per_replica": counts, "max_load_deviation": max(abs(c - mean) for c in counts) / mean,
            "wall_seconds": wall}


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    trace = make_trace(_NUM_REQUESTS.value, _NUM_PREFIXES.value, _PREFIX_WORDS.value, _RATE.value, _SEED.value)
    # (router, policy, router flags) per fleet run: each --run is '[ROUTER:]POLICY [flags]'
    plan = [parse_run(value, _ROUTER.value) for value in _RUNS.value] or [
        (_ROUTER.value, policy, _ROUTER_FLAGS.value.strip()) for policy in _POLICIES.value]
    try:
        check_plan(plan)
    except ValueError as exc:
        raise app.UsageError(str(exc)) from exc
    runs = []
    for i, (router, policy, router_flags) in enumerate(plan):
        label = f"{router}:{policy} {router_flags}".strip()
        print(f"{label}: starting {_NUM_REPLICAS.value} replicas ...", flush=True)
        runs.append(run_policy(policy, trace, router_flags, log_dir=f"/tmp/paged_jax-fleet-{i}-{router}-{policy}",
                               router=router))
        r = runs[-1]
        print(f"{label}: hit rate {r['prefix_cache_hit_rate']:.3f}, TTFT p50 {r['ttft_s_p50']:.2f} s / p90 "
              f"{r['ttft_s_p90']:.2f} s, per replica {r['requests_per_replica']}, errors {len(r['errors'])}", flush=True)
    flag_values = {f.name: f.value for f in (_NUM_REPLICAS, _ROUTER, _POLICIES, _NUM_REQUESTS, _NUM_PREFIXES,
                                            _PREFIX_WORDS, _RATE, _MAX_TOKENS, _REPLICA_FLAGS, _ROUTER_FLAGS, _RUNS,
                                            _PORT, _SEED, _OUTPUT)}
    routers = ", ".join(sorted({r["router"] for r in runs}))  # the results-table row names each run's when several
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures={"runs": runs, "router": routers},
                                seed=_SEED.value))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
