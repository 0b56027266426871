"""One soak phase end to end: a live server on loopback, the traffic, the checks.

`run_phase` builds an engine with the given EngineConfig (one preemption mode per phase),
serves it in this process (BackgroundServer on 127.0.0.1, a free port), sends a plan of
requests (soak_traffic.py) while sampling the process's RSS, waits until the server is
idle, scrapes /metrics, reads the engine's bookkeeping for leaks, stops the server, and
replays every answered request on the same engine to check it (soak_checks.py). Used by
`python -m experiments.soak` and tests/experiments/test_soak.py, so the test runs the
soak's own code on a tiny plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from experiments.benchmarks import soak_checks as checks
from experiments.benchmarks.soak_traffic import SoakRequest, run_traffic

API_KEY = "soak-key"
logger = logging.getLogger(__name__)


def engine_config(**settings):
    """EngineConfig(**settings); `pool_check` is dropped (and reported as unavailable) on an
    engine that does not have the field yet."""
    from paged_jax.config.engine_config import EngineConfig
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "pool_check" not in fields and settings.pop("pool_check", None) not in (None, "off"):
        logger.warning("EngineConfig has no pool_check: the per-step pool check is not run")
    return EngineConfig(**settings)


def _count_swap_outs(bm) -> list[int]:
    """[sequences swapped out so far] of BlockManager `bm` (a counter around its swap_out)."""
    count, swap_out = [0], bm.swap_out

    def counting(seq_ids):
        count[0] += len(seq_ids)
        return swap_out(seq_ids)

    bm.swap_out = counting
    return count


def wait_idle(loop, timeout: float) -> float | None:
    """Seconds until the engine loop holds nothing (None: still busy after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        s = loop.stats()
        if not (s["num_running"] or s["num_waiting"] or s.get("num_swapped", 0) or s["num_pending"]
                or loop.has_requests()):
            time.sleep(0.2)  # one more publish after the last step
            s = loop.stats()
            if not (s["num_running"] or s["num_waiting"] or s.get("num_swapped", 0) or s["num_pending"]):
                return time.monotonic() - start
        time.sleep(0.05)
    return None


STATS_KEYS = ("num_preemptions", "num_steps", "prefix_cache_query_tokens", "prefix_cache_hit_tokens",
              "num_prefix_cache_evictions", "num_blocks_used", "num_blocks_free", "num_blocks_total",
              "num_blocks_cached", "num_running", "num_waiting", "num_swapped", "num_compilations_after_warm_up",
              "num_pool_check_failures", "mean_batched_seqs", "max_batched_seqs", "host_seconds_per_step",
              "device_seconds_per_step")


@dataclasses.dataclass
class Phase:
    figures: dict  # what the record keeps
    results: list  # SoakResult per request of the plan
    engine: object  # the LLMEngine served (idle, stopped server: free for offline use)


def run_phase(loaded, config, plan: list[SoakRequest], *, model_name: str = "smollm2-135m",
              max_concurrency: int = 48, idle_timeout: float = 120, show_progress: bool = True,
              rss_interval: float = 0.5) -> Phase:
    """Serve `plan` on a fresh engine built from `config` (`loaded`: a LoadedModel), then
    check everything."""
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.entrypoints.openai import ServerSettings, build_app
    from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer

    start = time.perf_counter()
    engine = LLMEngine(loaded, config)
    build_s = time.perf_counter() - start
    checker = getattr(engine.core, "pool_checker", None)
    swapped_out = _count_swap_outs(engine.block_manager)
    settings = ServerSettings(served_model_name=model_name, api_key=API_KEY,
                              max_waiting_requests=10 * len(plan) * max(r.n for r in plan))
    server = BackgroundServer(build_app(engine, settings))
    loop = server.loop
    done = [0]
    bar = None
    if show_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(plan), desc=f"soak ({config.preemption_mode})", mininterval=2.0)

    def on_done(result):
        done[0] += 1
        if bar is not None:
            bar.update(1)
            if done[0] % 50 == 0:
                s = loop.stats()
                bar.set_postfix(preempt=s.get("num_preemptions"), run=s.get("num_running"),
                                wait=s.get("num_waiting"), swap=s.get("num_swapped"), refresh=False)

    sampler = checks.RssSampler(lambda: done[0], interval=rss_interval)
    try:
        start = time.perf_counter()
        results = asyncio.run(run_traffic(server.base_url, plan, model=model_name, api_key=API_KEY,
                                          max_concurrency=max_concurrency, on_done=on_done))
        traffic_s = time.perf_counter() - start
        samples = sampler.stop()
        if bar is not None:
            bar.close()
        idle_s = wait_idle(loop, idle_timeout)
        metrics = checks.scrape(server.base_url)
        stats = loop.stats()
        pool_checks = getattr(checker, "num_checks", None)
        num_swapped_out = swapped_out[0]  # before the replay, which swaps too
        book = checks.bookkeeping(engine, loop)  # idle: the engine thread waits on its condition
    finally:
        if sampler.running:
            samples = sampler.stop()
        server.stop()
    stopped_cleanly = not server.thread.is_alive()
    served = {k: stats.get(k) for k in STATS_KEYS if k in stats}
    counters = checks.counter_agreement(metrics, plan, results, stats)
    errors = [r for r in results if r.error]
    answers = checks.check_answers(engine, plan, results)
    offline_book = checks.bookkeeping(engine)
    hits, queries = stats.get("prefix_cache_hit_tokens", 0), stats.get("prefix_cache_query_tokens", 0)
    answered = [r for r in results if checks.checkable(r)]
    figures = {
        "preemption_mode": config.preemption_mode, "num_requests": len(plan),
        "engine_build_s": round(build_s, 1), "traffic_s": round(traffic_s, 1),
        "idle_after_s": None if idle_s is None else round(idle_s, 2), "hang": idle_s is None,
        "requests_per_s": round(len(plan) / traffic_s, 2),
        "requests_by_kind": checks.counts_by_kind(plan, results),
        "answered": len(answered), "disconnects": sum(r.disconnected for r in results),
        "errors": len(errors), "server_errors_5xx": sum((r.status or 0) >= 500 for r in results),
        "error_examples": [{"request": r.index, "status": r.status, "error": r.error} for r in errors[:10]],
        "prompt_tokens": sum(len(plan[r.index].prompt_token_ids) for r in answered),
        "generated_tokens": sum(r.tokens_seen for r in answered),
        **{k: answers[k] for k in ("checked_choices", "mismatches", "near_ties", "usage_disagreements",
                                   "replay_seconds", "replay_engine")},
        "mismatch_examples": answers["mismatch_examples"], "near_tie_examples": answers["near_tie_examples"],
        "usage_examples": answers["usage_examples"],
        "leaks": checks.leaks(book), "bookkeeping_when_idle": book, "leaks_after_replay": checks.leaks(offline_book),
        "num_leaks": sum(1 for v in book.values() if v) + sum(1 for v in offline_book.values() if v),
        "pool_check": getattr(config, "pool_check", None),
        "pool_check_failures": stats.get("num_pool_check_failures"), "pool_checks_run": pool_checks,
        "pool_check_failures_with_replay": engine.stats().get("num_pool_check_failures"),  # serving + replay
        "preemptions": stats.get("num_preemptions"), "swapped_out_seqs": num_swapped_out,
        # preempted sequences that started over (all of them under recompute; under swap,
        # those the host swap space had no room for)
        "recomputed_seqs": stats.get("num_preemptions", 0) - num_swapped_out,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_cache_evictions": stats.get("num_prefix_cache_evictions"),
        "rss": checks.rss_drift(samples, len(plan)),
        "counters": counters, "server_stopped_cleanly": stopped_cleanly,
        "engine_stats": served,
    }
    return Phase(figures, results, engine)
