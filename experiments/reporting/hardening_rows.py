"""Results-table rows (docs/results.md) of the hardening records: the server's soak (experiments/soak.py: every
served answer against the offline engine, leaks, RSS, counters) and its schema fuzzing
(experiments/fuzz_server.py).

Split from results_rows.py as peer_rows.py is (results_rows imports these into BUILDERS
after defining the shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def soak(record: dict) -> list:
    """The soak of the server (experiments/soak.py): requests and minutes, answers checked
    against the offline engine, leaks, pool checks, preemptions by mode, RSS drift, counters."""
    fig, flags = record["figures"], record["flags"]
    checked = fig["checked_choices"]
    modes = "; ".join(f"{m}: {p['preempted']} preempted ({p['swapped_out']} swapped out)"
                      for m, p in fig["preemptions_by_mode"].items())
    value = (f"{fig['requests']} requests in {fig['traffic_minutes']:.1f} min; {fig['mismatches']} mismatches in "
             f"{checked['greedy']} greedy + {checked['seeded']} seeded answers"
             + (f" + {checked['beam']} beams" if checked.get("beam") else "") + f" ({fig['near_ties']} near-ties); "
             f"{fig['leaks']} leaks, {fig['pool_check_failures']} pool-check failures, {fig['errors']} errors; "
             f"{modes}; prefix-cache hit rate {rr._pct(fig['prefix_cache_hit_rate'] or 0)}; "
             f"{fig['disconnects']} disconnects; RSS drift {fig['rss_drift_pct_max']:+.1f}% max; counters "
             f"{'agree' if fig['counters_agree'] else 'DISAGREE'}" + rr._cpu_note(record))
    return [((f"soak of the server, {rr.model_label(fig.get('model'))}, Poisson at {flags.get('rate')} req/s, "
              f"{flags.get('num_blocks')} KV blocks of {flags.get('block_size')}, phases "
              f"{rr._join(flags.get('preemption_modes') or [])}: completions + chat, streamed or not, greedy + "
              f"seeded{' + beams' if flags.get('beam_fraction') else ''}, n <= {flags.get('max_n')}, stop strings, shared prefixes, disconnects; every answer vs the "
              f"offline engine, pool checked every step"), value)]


def fuzz_server(record: dict) -> list:
    """Schema fuzzing of every endpoint (experiments/fuzz_server.py): cases and status codes
    per endpoint, failures, schema-violating cases served, and the engine after the fuzz."""
    fig, flags = record["figures"], record["flags"]
    per_op = "; ".join(f"{label} {op['cases']} ({', '.join(f'{code}: {n}' for code, n in op['status_codes'].items())})"
                       for label, op in fig["operations"].items() if op["cases"] > 1)
    gets = [label.split()[1] for label, op in fig["operations"].items() if op["cases"] <= 1]
    checks = fig["checks"]
    value = (f"{fig['cases']} cases in {fig['seconds']:.0f} s: {fig['num_failures']} failures, "
             f"{fig['num_negative_accepted']} schema-violating cases served; {per_op}; {', '.join(gets)} once each; "
             f"after: greedy completion + chat {'equal to' if checks['greedy_equal'] else 'DIFFER from'} offline, "
             f"/health {checks['health_status']}, KV blocks {'all free' if checks['all_blocks_free'] else 'LEAKED'}"
             + rr._cpu_note(record))
    return [((f"schema fuzzing of the server (schemathesis {fig['versions']['schemathesis']}), "
              f"{rr.model_label(fig.get('model'))}: every operation of its /openapi.json, up to "
              f"{flags.get('max_examples')} cases each, half violating the schema (max_tokens <= "
              f"{flags.get('case_max_tokens')}, n <= {flags.get('case_n')}); a failure is a 5xx, a hang over "
              f"{flags.get('request_timeout_s'):g} s, a 4xx not in OpenAI's error shape, or a body off its "
              f"documented schema"), value)]
