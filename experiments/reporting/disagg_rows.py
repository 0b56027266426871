"""Results-table rows (docs/results.md) of the disaggregated prefill / decode records: in one driver process
(experiments/disagg_prefill_decode.py: outputs against one mixed engine, the K/V moved
per request, and the short requests' TPOT / TTFT in both setups) and through the router
(experiments/fleet_pd.py: the same trace over HTTP, vllm-router's prefill / decode mode
against one mixed replica behind it).

Split from results_rows.py as peer_rows.py is (results_rows imports it into BUILDERS
after defining the shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def disagg_prefill_decode(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    modes = fig["modes"]
    parts = []
    if "outputs_equal" in fig:
        parts.append(f"greedy outputs equal to the mixed engine's: {fig['outputs_equal']} / {flags['num_requests']}")
    split = modes.get("disaggregated", {}).get("kv_transfer")
    if split:
        parts.append(f"K/V moved {split['kv_bytes_per_request_mean'] / 1e6:.1f} MB per request, pull p50 "
                     f"{split['pull_ms_p50']:.0f} ms (max {split['pull_ms_max']:.0f} ms), import p50 "
                     f"{split['import_ms_p50']:.1f} ms")
    for mode, m in modes.items():
        s = m["short"]
        parts.append(f"{mode}: short requests' TPOT p50 {1e3 * s['tpot_s_p50']:.0f} ms / p90 "
                     f"{1e3 * s['tpot_s_p90']:.0f} ms, TTFT p50 {s['ttft_s_p50']:.2f} s")
    pinned = "prefill on core 0, decode on core 1" if flags.get("pin_cores", True) else "both on both cores"
    return [((f"disaggregated prefill / decode, {rr.model_label(flags.get('model'))}, two processes "
              f"({pinned}; jax.experimental.transfer) vs one mixed engine (both cores): {flags['num_requests']} "
              f"requests ({fig['num_long']} with {flags['long_prompt_len']}-token prompts, the rest "
              f"{flags['short_prompt_len']}), {flags['output_len']} tokens each, Poisson {flags['request_rate']}/s"),
             "; ".join(parts) + rr._cpu_note(record))]


def fleet_pd(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    parts = []
    if "outputs_compared" in fig:
        parts.append(f"greedy outputs equal: {fig['outputs_equal']} / {fig['outputs_compared']}")
    for r in fig["runs"]:
        parts.append(f"{r['mode']} ({r['num_replicas']} replica{'s' if r['num_replicas'] > 1 else ''}, "
                     f"{r['num_ok']} ok): short requests' TPOT p50 {1e3 * r['short_tpot_s_p50']:.0f} ms / p90 "
                     f"{1e3 * r['short_tpot_s_p90']:.0f} ms, TTFT p50 {r['short_ttft_s_p50']:.2f} s / p90 "
                     f"{r['short_ttft_s_p90']:.2f} s")
    return [((f"prefill / decode through {fig['router']} (a prefill and a decode serve_local replica, "
              f"jax.experimental.transfer, sharing both cores) vs one mixed replica behind it: {fig['num_requests']} "
              f"requests ({fig['num_long']} with {flags['long_prompt_len']}-token prompts, the rest "
              f"{flags['short_prompt_len']}), {flags['output_len']} tokens each, Poisson {flags['request_rate']}/s"),
             "; ".join(parts) + rr._cpu_note(record))]
