"""What /dashboard costs the engine: a snapshot against a step, and 10 viewers against none.

    python -m experiments.dashboard_cost                      # SmolLM2-135M, 3,000 blocks, 32 sequences (~5 min)
    python -m experiments.dashboard_cost --rounds=1 --steps=10 --output=dashboard_cost_dry   # a quick run

Why: the dashboard must not slow what it shows. Its only work on the engine thread is
the snapshot (engine/pool_snapshot.py: one pass over the pool's blocks, the tables of
the listed sequences, the counters), taken between steps at most --dashboard_max_rate
times a second while someone watches; serializing it and sending it to every viewer runs
on the server's event loop. Two measurements:

  snapshot vs step: one LLMEngine with --num_blocks blocks (3,000 in the target) and
    --num_seqs sequences decoding (32 in the target: prompts of --prompt_tokens, greedy,
    ignore_eos); after each of --steps decode steps, one snapshot, timed apart from the
    step, and its JSON encoding (event-loop work) timed too. Target: snapshot <= 1% of
    the step (medians).
  viewers vs none: the same engine behind the in-process server, --num_seqs streamed
    requests of --max_tokens tokens sent at once, with 0 and with --viewers open
    /dashboard/events streams (read by a separate process, as browsers would be), in
    alternating rounds (A B A B: this VM is noisy); the engine's steps per second and
    mean step time over each run, and the engine-thread seconds spent on snapshots.
    The difference between conditions is set against the spread between rounds of the
    same condition.

Writes experiments/results/<output>.json.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 3001, "EngineConfig.num_blocks (3,000 usable + the null block).")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "Sequences decoding at once (EngineConfig.max_num_seqs).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 256, "Prompt length of every sequence.")
_STEPS = flags.DEFINE_integer("steps", 40, "Decode steps timed with a snapshot after each.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "Tokens per request in the viewers comparison.")
_VIEWERS = flags.DEFINE_integer("viewers", 10, "Open /dashboard/events streams in the viewers condition.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Rounds of (no viewers, viewers), alternated.")
_RATE = flags.DEFINE_float("dashboard_max_rate", 4.0, "ServerSettings.dashboard_max_rate.")
_OUTPUT = flags.DEFINE_string("output", "dashboard_cost", "Result name: experiments/results/<output>.json.")

BLOCK_SIZE = 16


def _config():
    from paged_jax.config.engine_config import EngineConfig
    n = _NUM_SEQS.value
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=_NUM_BLOCKS.value, max_model_len=1024, max_num_seqs=n,
                        max_num_batched_tokens=512, seq_buckets=(n,), token_buckets=(n, 512))


def _prompts(vocab_size: int) -> list[list[int]]:
    return [[(97 + 31 * i + 7 * j) % (vocab_size - 200) + 100 for j in range(_PROMPT_TOKENS.value)]
            for i in range(_NUM_SEQS.value)]


def snapshot_vs_step(engine) -> dict:
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.engine.pool_snapshot import take_snapshot
    # long enough that no sequence finishes during the prefill and the timed steps
    params = SamplingParams(temperature=0, max_tokens=1024 - _PROMPT_TOKENS.value, ignore_eos=True)
    for i, ids in enumerate(_prompts(engine.model_config.vocab_size)):
        engine.add_request(f"s{i}", {"prompt_token_ids": ids}, params)
    sched = engine.scheduler
    while sched.waiting or any(not s.output_token_ids for s in sched.running):
        engine.step()  # prefill until every sequence decodes
    steps, snaps, encodes = [], [], []
    for _ in range(_STEPS.value):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        snap = take_snapshot(engine.core)
        t2 = time.perf_counter()
        json.dumps(snap, separators=(",", ":"))
        t3 = time.perf_counter()
        steps.append(t1 - t0)
        snaps.append(t2 - t1)
        encodes.append(t3 - t2)
    running = len(engine.scheduler.running)
    for i in range(_NUM_SEQS.value):
        engine.abort_request(f"s{i}")
    step_ms, snap_ms = statistics.median(steps) * 1e3, statistics.median(snaps) * 1e3
    return {"num_blocks": _NUM_BLOCKS.value - 1, "num_seqs_decoding": running,
            "blocks_used": len(snap["blocks"]) - snap["blocks"].count("0") - 1,
            "step_ms_median": round(step_ms, 3), "snapshot_ms_median": round(snap_ms, 4),
            "snapshot_ms_max": round(max(snaps) * 1e3, 4), "json_ms_median": round(statistics.median(encodes) * 1e3, 4),
            "snapshot_json_bytes": len(json.dumps(snap, separators=(",", ":"))),
            "snapshot_fraction_of_step": round(snap_ms / step_ms, 5), "goal_fraction": 0.01,
            "meets_goal": snap_ms / step_ms <= 0.01}


def _viewer_process(url: str, count: int, ready, stop) -> None:
    """`count` SSE readers of `url` in one process, until `stop` is set."""
    import httpx

    async def one():
        async with httpx.AsyncClient(timeout=None) as client:
            async with client.stream("GET", url) as r:
                ready.release()
                async for _ in r.aiter_lines():
                    if stop.is_set():
                        return

    async def main():
        tasks = [asyncio.create_task(one()) for _ in range(count)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def _serve_burst(server, model_name: str, vocab_size: int) -> float:
    import httpx

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
            bodies = [{"model": model_name, "prompt": ids, "max_tokens": _MAX_TOKENS.value, "temperature": 0,
                       "ignore_eos": True, "stream": True} for ids in _prompts(vocab_size)]

            async def one(body):
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
            await asyncio.gather(*(one(b) for b in bodies))

    start = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - start


def _busy_seconds(stats: dict) -> float:
    """The engine's host + device seconds in steps so far (stats keep them per step)."""
    return (stats["host_seconds_per_step"] + stats["device_seconds_per_step"]) * stats["num_steps"]


def viewers_vs_none(engine, model_name: str) -> dict:
    from paged_jax.entrypoints.openai import ServerSettings, build_app
    from paged_jax.entrypoints.openai.uvicorn_server import BackgroundServer
    application = build_app(engine, ServerSettings(served_model_name=model_name, dashboard_max_rate=_RATE.value))
    server = BackgroundServer(application)
    feed, vocab = application.state.dashboard, engine.model_config.vocab_size
    runs = []
    try:
        _serve_burst(server, model_name, vocab)  # warm: the server's first requests
        for r in range(_ROUNDS.value):
            for viewers in (0, _VIEWERS.value):
                ctx = multiprocessing.get_context("spawn")
                ready, stop, proc = ctx.Semaphore(0), ctx.Event(), None
                if viewers:
                    proc = ctx.Process(target=_viewer_process, args=(server.base_url + "/dashboard/events", viewers,
                                                                     ready, stop))
                    proc.start()
                    for _ in range(viewers):
                        ready.acquire(timeout=120)
                    time.sleep(1.0)
                before, snaps_before, snap_s_before = server.loop.stats(), feed.num_snapshots, feed.snapshot_seconds
                wall = _serve_burst(server, model_name, vocab)
                after = server.loop.stats()
                steps = after["num_steps"] - before["num_steps"]
                step_s = _busy_seconds(after) - _busy_seconds(before)
                runs.append({"round": r, "viewers": viewers, "wall_s": round(wall, 3), "steps": steps,
                             "steps_per_s": round(steps / wall, 3), "mean_step_ms": round(1e3 * step_s / steps, 3),
                             "snapshots": feed.num_snapshots - snaps_before,
                             "snapshot_s": round(feed.snapshot_seconds - snap_s_before, 4)})
                print(json.dumps(runs[-1]), flush=True)
                if proc is not None:
                    stop.set()
                    proc.join(30)
    finally:
        server.stop()
    by = {v: [x for x in runs if x["viewers"] == v] for v in (0, _VIEWERS.value)}
    rate = {v: statistics.mean(x["steps_per_s"] for x in xs) for v, xs in by.items()}
    spread = max(max(x["steps_per_s"] for x in xs) - min(x["steps_per_s"] for x in xs) for xs in by.values())
    with_viewers = by[_VIEWERS.value]
    return {"runs": runs, "steps_per_s_no_viewers": round(rate[0], 3),
            "steps_per_s_viewers": round(rate[_VIEWERS.value], 3),
            "change_pct": round(100 * (rate[_VIEWERS.value] / rate[0] - 1), 2),
            "spread_between_rounds_pct": round(100 * spread / rate[0], 2),
            "snapshot_share_of_wall_pct": round(100 * sum(x["snapshot_s"] for x in with_viewers)
                                                / sum(x["wall_s"] for x in with_viewers), 3)}


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.loading import load_model
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    loaded = load_model(_MODEL.value)
    engine = LLMEngine(loaded, _config())
    figures = {"model": loaded.source, "snapshot_vs_step": snapshot_vs_step(engine)}
    print(json.dumps(figures["snapshot_vs_step"]), flush=True)
    figures["viewers_vs_none"] = viewers_vs_none(engine, _MODEL.value)
    summary = {k: v for k, v in figures["viewers_vs_none"].items() if k != "runs"}
    print(json.dumps(summary), flush=True)
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
