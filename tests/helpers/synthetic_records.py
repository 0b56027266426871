"""Small synthetic results records, in the schemas of experiments that are still being
written (serving_sweep, sweep_block_size) or changed (benchmark_throughput's timeline):
what tests/experiments/test_plots.py and tests/experiments/test_results_table.py feed the plots and the table."""

import numpy as np


def _record(name, figures, flags=None):
    return {"name": name, "command": f"python -m experiments.{name}", "time_utc": "2026-01-01T00:00:00+00:00",
            "flags": flags or {}, "seed": 0, "environment": {"platform": "cpu", "cpu_count": 2}, "figures": figures}


def throughput_record():
    """benchmark_throughput with the timeline fields the lead is adding."""
    rows = []
    for name, util, batched in (("paged", 0.95, [3, 6, 8, 8, 7, 2]), ("contiguous-max", 0.25, [1, 2, 2, 2, 2, 2])):
        rows.append({"kv_allocator": name, "kv_utilization": util, "waste_internal_slots": 40.0 if util < 0.5 else 1.0,
                     "waste_reservation_slots": 20.0, "waste_external_slots": 5.0, "mean_batched_seqs": float(np.mean(batched)),
                     "max_batched_seqs": max(batched), "saturated_mean_batched_seqs": float(max(batched)),
                     "batched_seqs_timeline": batched, "timeline_stride": 4, "output_tokens_per_s": 10.0,
                     "num_blocks_total": 16})
    return _record("benchmark_throughput", {
        "model": "random:tiny_llama", "workload": "sharegpt", "engine_settings": {"block_size": 8, "num_blocks": 17},
        "allocators": rows, "paper_utilization_existing_systems": [0.204, 0.382]}, {"num_requests": 12})


def serving_sweep_record():
    allocators = [{"kv_allocator": name, "points": [
        {"request_rate": rate, "normalized_latency_s_per_token": base * (1 + rate ** 3), "ttft_p50_s": 0.1,
         "tpot_p50_s": 0.05, "output_tokens_per_s": 20 * rate, "mean_batched_seqs": 4 * rate} for rate in (0.5, 1.0, 2.0)]}
        for name, base in (("paged", 0.05), ("contiguous-max", 0.2))]
    return _record("serving_sweep", {"model": "random:tiny_llama", "workload": "sharegpt", "allocators": allocators,
                                     "sustained_rate": {"paged": 1.0, "contiguous-max": None}}, {"num_requests": 20})


def block_sweep_record():
    rows = [{"workload": w, "block_size": b, "kv_utilization": 1 - b / s, "output_tokens_per_s": 30 + b / 4 - b * b / s,
             "kernel_ms": 2.0 + 8 / b, "mean_batched_seqs": 10 - b / 32}
            for w, s in (("sharegpt", 400), ("alpaca", 100)) for b in (8, 16, 32, 64)]
    preemption = [{"block_size": b, "preemption_mode": m, "output_tokens_per_s": s * b ** 0.5, "num_preemptions": 3,
                   "wall_seconds": 5.0} for b in (8, 16, 32) for m, s in (("recompute", 4.0), ("swap", 3.0))]
    return _record("sweep_block_size", {"model": "random:tiny_llama", "rows": rows, "preemption": preemption})


def step_time_record():
    """calibrate_step_time's record (figures.model is the fitted StepTimeModel as a dict)."""
    errors = {"mean_relative_error": 0.05, "p90_relative_error": 0.11, "max_relative_error": 0.3,
              "total_relative_error": 0.01}
    return _record("calibrate_step_time", {
        "model": {"intercept_s": 0.012, "per_token_s": 0.0004, "per_seq_s": 0.0001, "per_context_token_s": 2e-6,
                  "source": "tiny on x86_64"},
        "fit": {"num_steps": 300, "workload": "sharegpt", **errors},
        "holdout": {"num_steps": 120, "workload": "alpaca", **errors, "mean_relative_error": 0.08}})
