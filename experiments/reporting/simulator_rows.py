"""Results-table row (docs/results.md) of the simulator's profile (experiments/profile_simulator.py): how its
steps split between real engine steps, schedule()-only steps and directly applied ones,
and where the time goes.

Split from results_rows.py as peer_rows.py is (results_rows imports it into BUILDERS
after defining the shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def profile_simulator(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    how = "under cProfile" if fig["profiled"] else "no profiler"
    parts = [f"{fig['wall_seconds']:.1f} s wall ({how}) for {fig['num_steps']} steps: {fig['real_steps']} "
             f"engine.step(), {fig['lean_steps']} schedule() only, {fig['fast_forwarded_steps']} applied directly "
             f"({fig['prefill_steps']} with a prefill chunk, {fig['preempting_steps']} preempting, "
             f"{fig['admitting_steps']} admitting, {fig['finishing_steps']} finishing); {fig['num_preemptions']} "
             f"preemptions"]
    if fig.get("top_cumulative"):
        top = [r for r in fig["top_cumulative"] if "run" not in r["function"].split("(")[-1]][:4]
        parts.append("most cumulative time: " + ", ".join(f"{r['function'].split(':')[0].rsplit('/', 1)[-1]}:"
                                                           f"{r['function'].split('(')[-1].rstrip(')')} "
                                                           f"{r['cumulative_s']:.0f} s" for r in top))
    return [((f"simulator profile, one engine (paged, block {flags['block_size']}, {flags['max_num_seqs']} "
              f"sequences, {flags['max_num_batched_tokens']} tokens), {flags['num_requests']} "
              f"{flags['workload']}-like requests at t = 0"), "; ".join(parts) + rr._cpu_note(record))]
