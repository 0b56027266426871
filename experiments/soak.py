"""Soak of the OpenAI-compatible server: hours-shaped traffic in minutes, every answer checked.

    python -m experiments.soak                                  # 5,000 requests, recompute then swap
    python -m experiments.soak --num_requests=400 --rate=4      # a short run

Why: a server that answers a test's dozen requests correctly can still leak blocks,
drift in memory, miscount its metrics or give a wrong token once preemption, prefix-cache
eviction, parallel sampling and disconnecting clients interleave for a while. This runs
them all together, on loopback, against a live in-process server (the app of
`python -m experiments.serve_local`, in a BackgroundServer) on SmolLM2-135M with a tight
KV budget, so sequences are preempted all the time, and then checks:

  * answers: every greedy answer against the offline engine's for the same prompt token
    ids and parameters, every seeded sampled answer against its seed's offline replay
    (same seed, same tokens), every beam search's beams against the offline beam search's
    (token for token, no tie allowance), the offline runs made on the server's own engine (the same
    EngineConfig) once the server has stopped; a difference is accepted only at a
    near-tie (tests/helpers/greedy_check.py; experiments/benchmarks/soak_checks.py);
  * the block pool after every step (EngineConfig.pool_check="step": failures counted in
    the stats) and, once the traffic is over, no leak: every block free or cached, no
    request or sequence left in the engine's or the server's bookkeeping;
  * RSS: its drift from after the first 10% of each phase's requests to the end (goal <= 5%);
  * /metrics: request successes by finish reason, aborts, prompt and generated tokens,
    preemptions and prefix-cache hits against the clients' own counts and the engine's stats.

The requests are split over one phase per --preemption_modes entry (a fresh server each,
so both recompute and swap preemption are forced). The traffic (experiments/benchmarks/
soak_traffic.py) mixes /v1/completions and /v1/chat/completions, streamed and not, greedy
and seeded sampling, n up to --max_n, stop strings, logprobs, --num_prefixes long shared
system prompts, --beam_fraction beam searches (`use_beam_search`, n = 2..--max_n beams), and
clients that disconnect mid-stream (their requests are not checked but must be aborted).
Writes experiments/results/<--output>.json.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source with a tokenizer).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 5000, "Requests in all, split evenly over the phases.")
_RATE = flags.DEFINE_float("rate", 3.5, "Poisson arrival rate, requests per second (0: all at once).")
_MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", 48, "Requests in flight at most (later arrivals wait).")
_MODES = flags.DEFINE_list("preemption_modes", ["recompute", "swap"], "One phase (a fresh server) per mode.")
_MIN_TOKENS = flags.DEFINE_integer("min_tokens", 4, "Least max_tokens of a request.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 24, "Most max_tokens of a request.")
_MAX_N = flags.DEFINE_integer("max_n", 3, "Largest n (parallel completions) of a request.")
_NUM_PREFIXES = flags.DEFINE_integer("num_prefixes", 4, "Long shared system prompts (prefix-cache hits and evictions).")
_PREFIX_WORDS = flags.DEFINE_integer("prefix_words", 70, "Words per shared prefix (~1.5 tokens each).")
_BEAMS = flags.DEFINE_float("beam_fraction", 0.04, "Fraction of requests that are beam searches (n = 2..max_n).")
_DISCONNECT = flags.DEFINE_float("disconnect_fraction", 0.04, "Fraction of clients that go away mid-request.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "EngineConfig.block_size.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 96, "EngineConfig.num_blocks: the tight KV budget (incl. the "
                                   "null block).")
_SWAP_SPACE = flags.DEFINE_integer("swap_space_bytes", 64 * 2**20, "EngineConfig.swap_space_bytes (host memory "
                                   "for swapped blocks; small, so its pages are all touched early and the RSS "
                                   "drift measures leaks, not the first use of the swap space).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "EngineConfig.max_model_len.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "EngineConfig.max_num_seqs.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 128, "EngineConfig.max_num_batched_tokens.")
_SEQ_BUCKETS = flags.DEFINE_list("seq_buckets", ["8", "16", "32"], "EngineConfig.seq_buckets (few: fast compiles).")
_TOKEN_BUCKETS = flags.DEFINE_list("token_buckets", ["32", "64", "128"], "EngineConfig.token_buckets.")
_LAYER_LOOP = flags.DEFINE_enum("layer_loop", "scan", ["auto", "unroll", "scan"],
                                "EngineConfig.layer_loop (scan compiles SmolLM2's 30 layers much faster).")
_POOL_CHECK = flags.DEFINE_enum("pool_check", "step", ["off", "idle", "step"],
                                "EngineConfig.pool_check: the block-manager invariant walk after every step.")
_MAX_DRIFT = flags.DEFINE_float("max_rss_drift_pct", 5.0, "RSS drift (warm-up to end) the soak accepts.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the traffic plan (phase i: seed + i) and the engine.")
_OUTPUT = flags.DEFINE_string("output", "soak", "Record name: experiments/results/<output>.json.")


def _engine_settings(mode: str) -> dict:
    return dict(block_size=_BLOCK_SIZE.value, num_blocks=_NUM_BLOCKS.value, max_model_len=_MAX_MODEL_LEN.value,
                max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=_MAX_BATCHED.value,
                seq_buckets=tuple(int(b) for b in _SEQ_BUCKETS.value),
                token_buckets=tuple(int(b) for b in _TOKEN_BUCKETS.value), layer_loop=_LAYER_LOOP.value,
                preemption_mode=mode, swap_space_bytes=_SWAP_SPACE.value, pool_check=_POOL_CHECK.value,
                seed=_SEED.value)


def summarize(phases: list[dict], max_drift_pct: float) -> dict:
    """The record's headline figures over all phases."""
    total = lambda key: sum(p[key] or 0 for p in phases)  # noqa: E731
    kinds: dict = {}
    for p in phases:
        for group, counts in p["requests_by_kind"].items():
            for k, v in counts.items():
                kinds.setdefault(group, {}).setdefault(k, 0)
                kinds[group][k] += v
    drifts = [p["rss"]["rss_drift_pct"] for p in phases]
    pool = [p["pool_check_failures_with_replay"] for p in phases]  # while serving, and in the offline replay
    queries = sum(p["engine_stats"].get("prefix_cache_query_tokens", 0) for p in phases)
    hits = sum(p["engine_stats"].get("prefix_cache_hit_tokens", 0) for p in phases)
    summary = {
        "requests": total("num_requests"), "requests_by_kind": kinds,
        "prompt_tokens": total("prompt_tokens"), "generated_tokens": total("generated_tokens"),
        "traffic_minutes": round(sum(p["traffic_s"] for p in phases) / 60, 2),
        "mismatches": total("mismatches"), "near_ties": total("near_ties"),
        "checked_choices": {k: sum(p["checked_choices"].get(k, 0) for p in phases) for k in ("greedy", "seeded", "beam")},
        "leaks": total("num_leaks"), "hangs": sum(p["hang"] for p in phases),
        "errors": total("errors"), "server_errors_5xx": total("server_errors_5xx"),
        "pool_check_failures": None if any(v is None for v in pool) else sum(pool),
        "preemptions_by_mode": {p["preemption_mode"]: {"preempted": p["preemptions"],
                                                       "swapped_out": p["swapped_out_seqs"],
                                                       "recomputed": p["recomputed_seqs"]} for p in phases},
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_cache_evictions": total("prefix_cache_evictions"),
        "disconnects": total("disconnects"),
        "rss_by_mode": {p["preemption_mode"]: p["rss"] for p in phases},
        "rss_drift_pct_max": max(drifts), "rss_ok": max(drifts) <= max_drift_pct,
        "counters_agree": all(p["counters"]["all_agree"] for p in phases),
        "usage_disagreements": total("usage_disagreements"),
    }
    summary["passed"] = bool(summary["mismatches"] == 0 and summary["leaks"] == 0 and not summary["hangs"]
                             and summary["errors"] == 0 and not summary["pool_check_failures"]
                             and summary["rss_ok"] and summary["counters_agree"]
                             and not summary["usage_disagreements"]
                             and all(p["preemptions"] for p in phases)
                             and all(p["swapped_out_seqs"] for p in phases if p["preemption_mode"] == "swap"))
    return summary


def main(argv):
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from experiments.benchmarks.soak_run import engine_config, run_phase
    from experiments.benchmarks.soak_traffic import make_plan
    from experiments.reporting.results_io import write_result
    from paged_jax.loading import load_model
    from paged_jax.worker.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    load_start = os.getloadavg()
    start = time.perf_counter()
    loaded = load_model(_MODEL.value)
    per_phase = _NUM_REQUESTS.value // len(_MODES.value)
    phases = []
    for i, mode in enumerate(_MODES.value):
        plan = make_plan(per_phase, rate=_RATE.value, tokenizer=loaded.tokenizer, seed=_SEED.value + i,
                         max_model_len=_MAX_MODEL_LEN.value, min_tokens=_MIN_TOKENS.value,
                         max_tokens=_MAX_TOKENS.value, num_prefixes=_NUM_PREFIXES.value,
                         prefix_words=_PREFIX_WORDS.value, disconnect_fraction=_DISCONNECT.value, max_n=_MAX_N.value,
                         beam_fraction=_BEAMS.value)
        config = engine_config(**_engine_settings(mode))
        print(f"phase {i + 1}/{len(_MODES.value)}: {per_phase} requests, preemption {mode}, "
              f"{config.num_blocks} blocks of {config.block_size}", flush=True)
        phase = run_phase(loaded, config, plan, model_name=_MODEL.value,
                          max_concurrency=_MAX_CONCURRENCY.value).figures
        gc.collect()  # the phase's engine, app and threads: their memory is not the next phase's RSS
        print(json.dumps({k: phase[k] for k in ("traffic_s", "requests_per_s", "mismatches", "near_ties",
                                                "num_leaks", "pool_check_failures", "preemptions", "errors",
                                                "disconnects", "prefix_cache_hit_rate", "rss")}), flush=True)
        phases.append(phase)
    summary = summarize(phases, _MAX_DRIFT.value)
    summary["wall_minutes"] = round((time.perf_counter() - start) / 60, 2)
    figures = {**summary, "model": loaded.source, "phases": phases,
               "load_average_before": load_start, "load_average_after": os.getloadavg(),
               "cpu_count": os.cpu_count()}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print(json.dumps({k: v for k, v in summary.items() if k not in ("requests_by_kind", "rss_by_mode")}, indent=1))
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    if not summary["passed"]:
        raise SystemExit("soak failed: see mismatches / leaks / errors / pool_check_failures / rss / counters above")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
