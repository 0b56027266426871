"""Disaggregated prefill / decode on two engine processes, against one mixed engine.

    python -m experiments.disagg_prefill_decode                       # SmolLM2, 40 requests
    python -m experiments.disagg_prefill_decode --num_requests=8 --model=random:tiny_llama

Why: in one engine a long prompt's prefill chunks share steps with everyone's decodes,
so each such step is slow for every decoding request (TPOT spikes); disaggregation runs
prefill on one engine and decode on another and moves the prompt's K/V between them
(paged_jax/engine/kv_transfer.py adopts them into the decode engine's prefix cache,
paged_jax/engine/kv_connector.py moves them: jax.experimental.transfer here).

The trace interleaves short chat-like requests (--short_prompt_len prompt, --output_len
tokens) with a stream of long prompts (--long_prompt_len); Poisson arrivals at
--request_rate, replayed in wall-clock time. Disaggregated: a prefill process (pinned to
core 0) runs each request with max_tokens=1 and exports its prompt blocks; a decode
process (core 1) pulls them through its transfer server, imports them and generates.
Mixed: one process (both cores) serves the same trace. Every request is greedy with
ignore_eos, so both must give the same tokens (compared one by one; a difference is
counted and reported, never dropped). Recorded: per-request KV bytes moved and pull /
import time, TTFT and TPOT p50 / p90 of the short requests (the decodes the long
prefills would stall) and of all, and wall time.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time

import numpy as np


def _define_flags():
    from absl import flags
    flags.DEFINE_string("model", "smollm2-135m", "Registered model name, or random:<configs preset> (random weights).")
    flags.DEFINE_integer("num_requests", 40, "Requests in the trace.")
    flags.DEFINE_float("long_fraction", 0.25, "Share of requests with a long prompt.")
    flags.DEFINE_integer("long_prompt_len", 768, "Tokens of a long prompt.")
    flags.DEFINE_integer("short_prompt_len", 48, "Tokens of a short prompt.")
    flags.DEFINE_integer("output_len", 32, "Output tokens per request (ignore_eos).")
    flags.DEFINE_float("request_rate", 1.0, "Poisson arrivals per second (wall clock).")
    flags.DEFINE_integer("max_num_seqs", 16, "Sequences per step, each engine.")
    flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step, each engine.")
    flags.DEFINE_integer("block_size", 16, "KV block size.")
    flags.DEFINE_integer("max_model_len", 1024, "Engine max_model_len.")
    flags.DEFINE_list("modes", ["mixed", "disaggregated"], "Which of mixed, disaggregated (each its own processes).")
    flags.DEFINE_bool("pin_cores", True, "Disaggregated: prefill process on core 0, decode on core 1 (each engine "
                                         "its own compute, as on two devices); false: both share every core.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_string("output", "disagg_prefill_decode", "Result name: experiments/results/<output>.json.")


def make_trace(num_requests: int, long_fraction: float, long_len: int, short_len: int, output_len: int,
               rate: float, vocab_size: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests)) if rate > 0 else np.zeros(num_requests)
    longs = rng.random(num_requests) < long_fraction
    return [{"request_id": str(i), "long": bool(is_long),
             "prompt": [int(t) for t in rng.integers(3, vocab_size, long_len if is_long else short_len)],
             "max_tokens": output_len, "arrival": float(a)}
            for i, (a, is_long) in enumerate(zip(arrivals, longs))]


def _engine(model: str, engine_options: dict):
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    if model.startswith("random:"):
        from experiments.bench_models import random_model
        loaded = random_model(model.split(":", 1)[1])
    else:
        from paged_jax.loading.loader import load_model
        loaded = load_model(model)
    return LLMEngine(loaded, EngineConfig(**engine_options))


def _params(max_tokens: int):
    from paged_jax.core.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _pin(cores) -> None:
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


def _drain(inbox, block: bool):
    items = []
    try:
        items.append(inbox.get(timeout=0.5) if block else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return items


def _finished(engine, out, times: dict) -> dict:
    m = out.metrics
    return {"request_id": out.request_id, "tokens": list(out.outputs[0].token_ids),
            "first_token_wall": times.pop(out.request_id) + (m["first_token_time"] - m["arrival_time"]),
            "finish_wall": time.time()}


def _serve_inbox(engine, inbox, add, finished) -> None:
    """Each worker's loop: add what arrives (None: no more), step, hand over what finished."""
    stop = False
    while not stop or engine.has_unfinished_requests():
        for item in _drain(inbox, block=not engine.has_unfinished_requests()):
            if item is None:
                stop = True
            else:
                add(item)
        for out in engine.step() if engine.has_unfinished_requests() else []:
            if out.finished:
                finished(out)


def mixed_worker(model, options, cores, inbox, results) -> None:
    """One engine serving everything (requests: dicts from make_trace, with their wall
    arrival `sent`); reports each finished request; None in the inbox stops it."""
    _pin(cores)
    engine = _engine(model, options)
    results.put(("ready", None))
    wall_at = {}

    def add(item):
        engine.add_request(item["request_id"], {"prompt_token_ids": item["prompt"]}, _params(item["max_tokens"]))
        wall_at[item["request_id"]] = time.time()
    _serve_inbox(engine, inbox, add, lambda out: results.put(("done", _finished(engine, out, wall_at))))
    results.put(("stats", engine.stats()))


def prefill_worker(model, options, cores, inbox, decode_inbox, results) -> None:
    """Runs each request's prompt (max_tokens=1), exports its blocks, saves them on its
    transfer server and hands the request with the connector's params to the decoder."""
    from paged_jax.engine.kv_connector import TransferServerConnector
    _pin(cores)
    engine = _engine(model, {**options, "kv_transfer": True})
    connector = TransferServerConnector()
    results.put(("ready", None))
    pending = {}

    def add(item):
        engine.add_request(item["request_id"], {"prompt_token_ids": item["prompt"]}, _params(1))
        pending[item["request_id"]] = item

    def finished(out):
        item = pending.pop(out.request_id)
        start = time.perf_counter()
        kv = engine.export_prompt_kv(item["prompt"])
        params = connector.save(out.request_id, kv) if kv is not None else None
        decode_inbox.put({**item, "kv_transfer_params": params, "export_s": time.perf_counter() - start,
                          "kv_bytes": kv.nbytes if kv is not None else 0})
    _serve_inbox(engine, inbox, add, finished)
    decode_inbox.put(None)
    results.put(("prefill_stats", engine.stats()))
    time.sleep(2.0)  # the last pulls may still be in flight: keep the transfer server up a moment


def decode_worker(model, options, cores, inbox, results) -> None:
    """Pulls each request's prompt K/V, imports it, and generates the whole output."""
    from paged_jax.engine.kv_connector import TransferServerConnector
    _pin(cores)
    engine = _engine(model, {**options, "kv_transfer": True})
    connector = TransferServerConnector()
    results.put(("ready", None))
    wall_at, transfers = {}, {}

    def add(item):
        start = pulled = time.perf_counter()
        written = 0
        if item["kv_transfer_params"] is not None:
            kv = connector.load(item["kv_transfer_params"], item["prompt"])
            pulled = time.perf_counter()
            written = engine.import_prompt_kv(kv)
        engine.add_request(item["request_id"], {"prompt_token_ids": item["prompt"]}, _params(item["max_tokens"]))
        wall_at[item["request_id"]] = time.time()
        transfers[item["request_id"]] = {"kv_bytes": item["kv_bytes"], "export_s": item["export_s"],
                                         "pull_s": pulled - start, "import_s": time.perf_counter() - pulled,
                                         "blocks_written": written}
    def finished(out):
        results.put(("done", {**_finished(engine, out, wall_at), **transfers.pop(out.request_id)}))
    _serve_inbox(engine, inbox, add, finished)
    results.put(("stats", engine.stats()))


def serve(mode: str, trace: list[dict], model: str, options: dict, timeout_s: float = 3600.0,
          pin_cores: bool = True) -> dict:
    """Run the trace through `mode`'s processes in wall-clock time; returns per-request
    records (by id, with arrival / first-token / finish wall times) and engine stats."""
    ctx = multiprocessing.get_context("spawn")
    results, inbox = ctx.Queue(), ctx.Queue()
    if mode == "mixed":
        workers = [ctx.Process(target=mixed_worker, args=(model, options, None, inbox, results))]
    else:
        decode_inbox = ctx.Queue()
        prefill_cores, decode_cores = ([0], [1]) if pin_cores else (None, None)
        workers = [ctx.Process(target=prefill_worker, args=(model, options, prefill_cores, inbox, decode_inbox,
                                                            results)),
                   ctx.Process(target=decode_worker, args=(model, options, decode_cores, decode_inbox, results))]
    for w in workers:
        w.start()
    try:
        for _ in workers:  # warm-up (compilation) is not timed
            kind, _payload = results.get(timeout=timeout_s)
            assert kind == "ready", kind
        start = time.time()
        records, stats = {}, {}
        for item in trace:
            delay = start + item["arrival"] - time.time()
            if delay > 0:
                time.sleep(delay)
            inbox.put({**item, "sent": time.time()})
            records[item["request_id"]] = {"arrival_wall": time.time(), "long": item["long"]}
        inbox.put(None)
        expected = len(workers) + len(trace)  # one stats message per worker
        while expected:
            kind, payload = results.get(timeout=timeout_s)
            expected -= 1
            if kind == "done":
                records[payload["request_id"]].update(payload)
            else:
                stats[kind] = payload
        for w in workers:
            w.join(timeout=30)
        return {"records": records, "stats": stats, "wall_s": time.time() - start}
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()


def summarize(run: dict) -> dict:
    recs = list(run["records"].values())

    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    def latencies(rs):
        ttft = [r["first_token_wall"] - r["arrival_wall"] for r in rs]
        tpot = [(r["finish_wall"] - r["first_token_wall"]) / (len(r["tokens"]) - 1) for r in rs if len(r["tokens"]) > 1]
        return {"ttft_s_p50": pct(ttft, 50), "ttft_s_p90": pct(ttft, 90), "tpot_s_p50": pct(tpot, 50),
                "tpot_s_p90": pct(tpot, 90), "num_requests": len(rs)}
    out = {"all": latencies(recs), "short": latencies([r for r in recs if not r["long"]]),
           "wall_s": run["wall_s"]}
    moved = [r for r in recs if "kv_bytes" in r]
    if moved:
        out["kv_transfer"] = {
            "kv_bytes_total": int(sum(r["kv_bytes"] for r in moved)),
            "kv_bytes_per_request_mean": float(np.mean([r["kv_bytes"] for r in moved])),
            "pull_ms_p50": 1e3 * pct([r["pull_s"] for r in moved], 50),
            "pull_ms_max": 1e3 * max(r["pull_s"] for r in moved),
            "import_ms_p50": 1e3 * pct([r["import_s"] for r in moved], 50),
            "export_ms_p50": 1e3 * pct([r["export_s"] for r in moved], 50),
            "mb_per_s_long": (sum(r["kv_bytes"] for r in moved if r["long"])
                              / max(sum(r["pull_s"] for r in moved if r["long"]), 1e-9) / 1e6),
            "blocks_written": int(sum(r["blocks_written"] for r in moved)),
        }
    return out


def main(argv):
    del argv
    from absl import flags

    import configs
    from experiments.reporting.results_io import write_result
    f = flags.FLAGS
    vocab = (configs.get_config(f.model.split(":", 1)[1]).vocab_size if f.model.startswith("random:") else 49152)
    trace = make_trace(f.num_requests, f.long_fraction, f.long_prompt_len, f.short_prompt_len, f.output_len,
                       f.request_rate, vocab, f.seed)
    options = {"block_size": f.block_size, "max_model_len": f.max_model_len, "max_num_seqs": f.max_num_seqs,
               "max_num_batched_tokens": f.max_num_batched_tokens}
    runs = {}
    for mode in f.modes:
        print(f"{mode}: {len(trace)} requests ({sum(r['long'] for r in trace)} long) ...", flush=True)
        runs[mode] = serve(mode, trace, f.model, options, pin_cores=f.pin_cores)
    figures = {"modes": {m: {**summarize(r), "stats": r["stats"]} for m, r in runs.items()},
               "num_long": sum(r["long"] for r in trace)}
    if "mixed" in runs and "disaggregated" in runs:
        a, b = runs["mixed"]["records"], runs["disaggregated"]["records"]
        equal = [i for i in a if a[i]["tokens"] == b[i]["tokens"]]
        figures["outputs_equal"] = len(equal)
        figures["outputs_differ"] = sorted(set(a) - set(equal), key=int)
    flag_values = {name: f[name].value for name in (
        "model", "num_requests", "long_fraction", "long_prompt_len", "short_prompt_len", "output_len", "request_rate",
        "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "modes", "pin_cores", "seed",
        "output")}
    print("wrote", write_result(f.output, flags=flag_values, figures=figures, seed=f.seed))
    for mode, fig in figures["modes"].items():
        s, t = fig["short"], fig.get("kv_transfer")
        print(f"{mode:>14}: short TPOT p50 {1e3 * s['tpot_s_p50']:.0f} ms / p90 {1e3 * s['tpot_s_p90']:.0f} ms, "
              f"TTFT p50 {s['ttft_s_p50']:.2f} s; wall {fig['wall_s']:.0f} s"
              + (f"; KV {t['kv_bytes_per_request_mean'] / 1e6:.1f} MB/request, pull p50 {t['pull_ms_p50']:.1f} ms"
                 if t else ""))
    if "outputs_equal" in figures:
        print(f"outputs equal: {figures['outputs_equal']} / {len(trace)}")


if __name__ == "__main__":
    from absl import app
    from absl import flags as absl_flags
    _define_flags()
    absl_flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
