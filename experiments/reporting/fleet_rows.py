"""Results-table row (docs/results.md) of the fleet simulation record (experiments/simulate_fleet.py): per routing
policy, the fleet's prefix-cache hit rate, TTFT p50 / p90, throughput and balance.

Split from results_rows.py as peer_rows.py is (results_rows imports it into BUILDERS
after defining the shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def simulate_fleet(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    parts = []
    for r in fig["runs"]:
        counts = r["requests_per_replica"]
        parts.append(f"{r['policy']}: hit rate {100 * r['prefix_cache_hit_rate']:.1f}%, TTFT p50 "
                     f"{r['ttft_s_p50']:.2f} s / p90 {r['ttft_s_p90']:.2f} s, {r['output_tokens_per_s']:.0f} tok/s, "
                     f"{min(counts)}-{max(counts)} requests per replica, {r['wall_seconds']:.0f} s wall")
    return [((f"simulated fleet (engine bookkeeping, modelled step times), {flags.get('num_replicas')} replicas of "
              f"{fig['num_blocks_per_replica']} KV blocks, {flags.get('num_requests')} {flags.get('workload')} "
              f"requests ({flags.get('num_prefixes')} prefixes of {flags.get('prefix_len')} tokens) at "
              f"{flags.get('request_rate')}/s: per routing policy"), "; ".join(parts) + rr._cpu_note(record))]


def fleet_prefix_routing(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    parts = []
    for r in fig["runs"]:
        counts = r["requests_per_replica"]
        router = f"{r['router']} " if r.get("router") and r["router"] != fig.get("router") else ""  # several routers
        label = router + r["policy"] + (f" ({r['router_flags']})" if r.get("router_flags") else "")
        parts.append(f"{label}: hit rate {100 * r['prefix_cache_hit_rate']:.1f}%, TTFT p50 {r['ttft_s_p50']:.2f} s"
                     f" / p90 {r['ttft_s_p90']:.2f} s, requests per replica {'/'.join(map(str, counts))} (max "
                     f"deviation {100 * r['max_load_deviation']:.0f}%), {len(r['errors'])} errors")
    behind = str(fig.get("router")).replace(", ", " or ")  # "sglang-router 0.2.3, vllm-router 0.1.17": per run
    return [((f"real fleet: {flags.get('num_replicas')} serve_local replicas (SmolLM2-135M-Instruct, sharing 2 cores) "
              f"behind {behind}{' (' + flags['router_flags'] + ')' if flags.get('router_flags') else ''}, "
              f"{flags.get('num_requests')} streamed requests on "
              f"{flags.get('num_prefixes')} system prompts of {flags.get('prefix_words')} words, Poisson "
              f"{flags.get('request_rate')}/s, {flags.get('max_tokens')} tokens each: per router policy"),
             "; ".join(parts) + rr._cpu_note(record))]
