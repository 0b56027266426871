"""Prefill / decode disaggregation through the router: two serve_local replicas behind
vllm-router's prefill / decode mode against one mixed replica behind the same router.

    bash experiments/setup_router.sh && python -m experiments.fleet_pd     # SmolLM2, 40 requests

Why: experiments/disagg_prefill_decode.py measures disaggregation inside one driver
process; this runs it as a user deploys it, over HTTP: `python -m experiments.serve_fleet
--pd` (a prefill replica and a decode replica, each `--kv_transfer
--kv_connector=jax_transfer`; the router sends each request to the prefill replica with
max_tokens=1 and vLLM's kv_transfer_params, then to the decode replica with the
parameters the prefill answered, and the decode replica pulls the prompt's K/V blocks
through its transfer server). The mixed fleet is one replica behind the router, so
both go through the same proxy. The trace is disagg_prefill_decode's (short chat-like
prompts and a stream of long ones, Poisson arrivals, token-id prompts, greedy with
ignore_eos), replayed over streaming completions; each request's tokens
(`return_token_ids`) must be equal in both fleets (a difference is counted and
reported). Recorded: TTFT and TPOT p50 / p90 of the short requests (the decodes long
prefills stall in a mixed engine) and of all, and wall time. The replicas share the
machine's cores (no pinning), as serve_fleet starts them.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time

import httpx
import numpy as np
from absl import app, flags

from experiments.disagg_prefill_decode import make_trace
from experiments.serve_fleet import make_fleet



# flags are defined in main's module only when run, so importing this (the tests) defines none
def _define_flags():
    flags.DEFINE_integer("num_requests", 40, "Requests in the trace.")
    flags.DEFINE_float("long_fraction", 0.25, "Share of requests with a long prompt.")
    flags.DEFINE_integer("long_prompt_len", 768, "Tokens of a long prompt.")
    flags.DEFINE_integer("short_prompt_len", 48, "Tokens of a short prompt.")
    flags.DEFINE_integer("output_len", 32, "Output tokens per request (ignore_eos).")
    flags.DEFINE_float("request_rate", 1.0, "Poisson arrivals per second.")
    flags.DEFINE_list("modes", ["mixed", "pd"], "Fleets to run, in order: mixed (one replica), pd.")
    flags.DEFINE_string("replica_flags", "--max_num_seqs=16 --max_num_batched_tokens=256 --max_model_len=1024",
                        "serve_local flags of every replica.")
    flags.DEFINE_integer("port", 18700, "Router port; replicas on port + 1 ...")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_string("output", "fleet_pd", "Result name: experiments/results/<output>.json.")


_FLAG_NAMES = ("num_requests", "long_fraction", "long_prompt_len", "short_prompt_len", "output_len", "request_rate",
               "modes", "replica_flags", "port", "seed", "output")
_MODEL = "smollm2-135m"
_VOCAB = 49152  # SmolLM2's vocabulary: the trace's token ids stay below it


async def _one(client, url: str, item: dict) -> dict:
    body = {"model": _MODEL, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=900) as response:
            if response.status_code != 200:
                return {"request_id": item["request_id"], "error": f"HTTP {response.status_code}: "
                                                                    f"{(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if ids:
                    last = time.perf_counter()
                    first = first or last
                    tokens += ids
    except httpx.HTTPError as exc:
        return {"request_id": item["request_id"], "error": type(exc).__name__}
    end = time.perf_counter()
    return {"request_id": item["request_id"], "long": item["long"], "tokens": tokens,
            "ttft_s": (first or end) - start,
            "tpot_s": (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None}


async def _replay(url: str, trace: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()

        async def at(item):
            await asyncio.sleep(max(0.0, start + item["arrival"] - time.perf_counter()))
            return await _one(client, url, item)
        return await asyncio.gather(*(at(item) for item in trace))


def _pct(values, q):
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def run_mode(mode: str, trace: list[dict], replica_flags: str, port: int, log_dir: str | None = None) -> dict:
    """Start the `mode` fleet (mixed: one replica; pd: prefill + decode) on `port`, replay
    `trace` through its router, stop it; the figures and every request's token ids."""
    pd = mode == "pd"
    fleet = make_fleet(2 if pd else 1, policy="round_robin", port=port, base_port=port + 1,
                       replica_args=shlex.split(replica_flags), pd=pd,
                       log_dir=log_dir or f"/tmp/paged_jax-fleet-{mode}")
    with fleet:
        # one throwaway request through the router: first-request costs out of the timings
        warm = {"model": _MODEL, "prompt": trace[0]["prompt"][:16], "max_tokens": 2, "temperature": 0}
        httpx.post(fleet.router_url + "/v1/completions", json=warm, timeout=300).raise_for_status()
        start = time.perf_counter()
        results = asyncio.run(_replay(fleet.router_url, trace))
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    short = [r for r in ok if not r["long"]]
    return {"mode": mode, "num_replicas": len(fleet.urls), "num_ok": len(ok),
            "errors": [r for r in results if "error" in r],
            "short_ttft_s_p50": _pct([r["ttft_s"] for r in short], 50),
            "short_ttft_s_p90": _pct([r["ttft_s"] for r in short], 90),
            "short_tpot_s_p50": _pct([r["tpot_s"] for r in short], 50),
            "short_tpot_s_p90": _pct([r["tpot_s"] for r in short], 90),
            "all_ttft_s_p50": _pct([r["ttft_s"] for r in ok], 50),
            "all_tpot_s_p50": _pct([r["tpot_s"] for r in ok], 50),
            "all_tpot_s_p90": _pct([r["tpot_s"] for r in ok], 90),
            "wall_seconds": round(wall, 2), "tokens": {r["request_id"]: r["tokens"] for r in ok}}


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    f = flags.FLAGS
    trace = make_trace(f.num_requests, f.long_fraction, f.long_prompt_len, f.short_prompt_len, f.output_len,
                       f.request_rate, _VOCAB, f.seed)
    runs = []
    for mode in f.modes:
        print(f"{mode}: starting its fleet ...", flush=True)
        runs.append(run_mode(mode, trace, f.replica_flags, f.port))
        r = runs[-1]
        print(f"{mode}: {r['num_ok']}/{len(trace)} ok; short requests TTFT p50 {r['short_ttft_s_p50']:.3f} s, "
              f"TPOT p50 {r['short_tpot_s_p50'] * 1e3:.1f} ms / p90 {r['short_tpot_s_p90'] * 1e3:.1f} ms; "
              f"wall {r['wall_seconds']} s", flush=True)
    figures = {"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
               "router": "vllm-router 0.1.17", "num_requests": len(trace),
               "num_long": sum(item["long"] for item in trace)}
    if len(runs) == 2:
        a, b = runs[0]["tokens"], runs[1]["tokens"]
        both = sorted(set(a) & set(b), key=int)
        different = [i for i in both if a[i] != b[i]]
        figures["outputs_compared"] = len(both)
        figures["outputs_equal"] = len(both) - len(different)
        figures["outputs_different"] = different
        print(f"outputs equal in {len(both) - len(different)} of {len(both)} requests", flush=True)
    flag_values = {name: f[name].value for name in _FLAG_NAMES}
    print("wrote", write_result(f.output, flags=flag_values, figures=figures, seed=f.seed))


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
