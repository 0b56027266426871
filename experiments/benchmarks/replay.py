"""Replaying a request trace against an in-process engine in real time, and the serving
figures of the result (no flags: a library for serving_sweep and tests).

The engine is stepped while it has work; a request is added once its arrival time has
passed, with that arrival as its `arrival_time`, so its latency counts the time it
would have queued in a server. Each finished request's arrival, first-token and finish
times come from the engine's own metrics.
"""

from __future__ import annotations

import collections
import time

import numpy as np


def replay(engine, trace, params_for, clock=time.monotonic, sleep=time.sleep) -> list[dict]:
    """Replay `trace` (experiments.benchmarks.workloads.Request, arrival_time in seconds from now)
    against `engine` in real time; returns one record per request: arrival, first-token
    and finish times (seconds from the start) and output tokens."""
    start = clock()
    pending = collections.deque(sorted(enumerate(trace), key=lambda item: item[1].arrival_time))
    done = []

    def admit_next():
        i, request = pending.popleft()
        engine.add_request(str(i), {"prompt_token_ids": list(request.prompt_token_ids)}, params_for(request),
                           arrival_time=start + request.arrival_time)

    while pending or engine.has_unfinished_requests():
        now = clock() - start
        while pending and pending[0][1].arrival_time <= now:
            admit_next()
        if not engine.has_unfinished_requests():
            sleep(max(0.0, pending[0][1].arrival_time - (clock() - start)))
            # the next request has arrived now; admit it without reading the clock again:
            # a virtual clock can land an ulp short of the arrival, and re-checking would
            # then sleep for ~0 s forever
            admit_next()
            continue
        for output in engine.step():
            if output.finished:
                m = output.metrics
                done.append({"arrival": m["arrival_time"] - start, "first_token": m["first_token_time"] - start,
                             "finish": m["finish_time"] - start,
                             "output_tokens": len(output.outputs[0].token_ids)})
    return done


def summarize(records: list[dict]) -> dict:
    """The serving figures of one point (times in seconds)."""
    e2e = np.array([r["finish"] - r["arrival"] for r in records])
    out = np.array([r["output_tokens"] for r in records])
    ttft = np.array([r["first_token"] - r["arrival"] for r in records])
    multi = out > 1
    tpot = (e2e[multi] - ttft[multi]) / (out[multi] - 1)
    span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None
    return {"normalized_latency_s_per_token": float(np.mean(e2e / out)),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p90_s": pct(tpot, 90), "tpot_p99_s": pct(tpot, 99),
            "e2e_p50_s": pct(e2e, 50), "output_tokens_per_s": float(out.sum() / span),
            "requests_per_s": len(records) / span, "num_requests": len(records)}


def sustained_rates(curves: dict[str, list[dict]], slo_factor: float) -> dict:
    """Per allocator, the highest rate with normalized latency <= slo_factor x the best
    normalized latency of any allocator at any rate (None if no rate meets it)."""
    best = min(p["normalized_latency_s_per_token"] for points in curves.values() for p in points)
    out = {}
    for allocator, points in curves.items():
        ok = [p["request_rate"] for p in points if p["normalized_latency_s_per_token"] <= slo_factor * best]
        out[allocator] = max(ok) if ok else None
    return out
