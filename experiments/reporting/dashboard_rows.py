"""Results-table row (docs/results.md) of the dashboard's cost record (experiments/dashboard_cost.py): a KV-pool
snapshot against an engine step, and the engine's step rate with viewers open vs none.

Split from results_rows.py as peer_rows.py is (results_rows imports it into BUILDERS
after defining the shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def dashboard_cost(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    s, v = fig["snapshot_vs_step"], fig["viewers_vs_none"]
    value = (f"snapshot {s['snapshot_ms_median']:.2f} ms median = {100 * s['snapshot_fraction_of_step']:.2f}% of "
             f"the {s['step_ms_median']:.0f} ms step (goal <= 1%; its JSON {s['json_ms_median']:.2f} ms, "
             f"{s['snapshot_json_bytes'] / 1e3:.0f} kB, on the event loop); {flags.get('viewers')} viewers: "
             f"{v['steps_per_s_viewers']:.2f} vs {v['steps_per_s_no_viewers']:.2f} steps/s without "
             f"({v['change_pct']:+.1f}%; same-condition rounds differ by up to {v['spread_between_rounds_pct']:.1f}%), "
             f"snapshots {v['snapshot_share_of_wall_pct']:.2f}% of the wall" + rr._cpu_note(record))
    return [((f"/dashboard's cost, {rr.model_label(fig.get('model'))}, {s['num_blocks']} KV blocks, "
              f"{s['num_seqs_decoding']} sequences decoding: one snapshot vs one step; the engine's steps/s with "
              f"{flags.get('viewers')} open /dashboard/events viewers vs none"), value)]
