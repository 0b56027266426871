"""PNG plots of the paper's figures from experiments/results/*.json.

    python -m experiments.plots                                  # every plot whose record exists
    python -m experiments.plots --only=sharing_savings,utilization_waste --out_dir=/tmp/plots

Why: the records hold the numbers; a figure shows the shape the paper argues from
(memory held vs. wasted by allocator, batch sizes over time, latency against load,
the block-size trade-off, sharing savings against the paper's ranges), and where the
served step stands against this CPU's roofline. Each plot is one function taking the
loaded record and the output directory and returning the PNG's path; a plot whose
results file is missing, or whose record lacks the figures it needs, is skipped with a
printed line. Titles name the model and workload from the record.
"""

from __future__ import annotations

import functools
import json
import os

from absl import app, flags

_RESULTS_DIR = flags.DEFINE_string("results_dir", os.path.join("experiments", "results"),
                                   "Directory of the results records (*.json).")
_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join("experiments", "plots"), "Where the PNGs go.")
_ONLY = flags.DEFINE_list("only", None, "Plot names to make (default: all): utilization_waste, batched_timeline, "
                                        "latency_vs_rate, block_size_sweep, sharing_savings, roofline, "
                                        "fleet_routing, real_fleet_routing.")

_DPI = 100  # 8 x 4.5 in at 100 dpi: readable on GitHub, ~50 KB per PNG
_WASTE_KINDS = (("waste_internal_slots", "internal (reserved, never used)"),
                ("waste_reservation_slots", "reservation (reserved for later tokens)"),
                ("waste_external_slots", "external (free gaps too short)"))


class SkipPlot(Exception):
    """The record exists but lacks what the plot needs (e.g. an older record's schema)."""


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    _pyplot().close(fig)
    return path


def _ordered(allocators: list[dict]) -> list[dict]:
    from experiments.reporting.results_rows import _sorted_allocators
    return _sorted_allocators(allocators)


def _labels(record: dict) -> tuple[str, str]:
    from experiments.reporting.results_rows import model_label, workload_label
    fig = record["figures"]
    return model_label(fig.get("model") or (record.get("flags") or {}).get("model")), workload_label(
        fig.get("workload") or (record.get("flags") or {}).get("workload"))


def tokens_held_slots(row: dict) -> tuple[float, bool]:
    """Mean token slots holding tokens per step, and whether it is estimated.

    Rows may carry it (`tokens_held_slots`); older ones only have kv_utilization u =
    held / allocated and the waste inside allocations (internal + reservation = allocated
    - held), so held ~= u / (1 - u) * (internal + reservation). Approximate: u is a mean
    of per-step ratios, not a ratio of means."""
    if row.get("tokens_held_slots") is not None:
        return float(row["tokens_held_slots"]), False
    u = row["kv_utilization"]
    inside = row["waste_internal_slots"] + row["waste_reservation_slots"]
    return (u / (1 - u) * inside if u < 1 else 0.0), True


def utilization_waste(record: dict, out_dir: str) -> str:
    """benchmark_throughput: utilization per allocator; slots held / wasted by kind (stacked)."""
    plt = _pyplot()
    fig_data = record["figures"]
    rows = _ordered(fig_data["allocators"])
    names = [r["kv_allocator"] for r in rows]
    model, workload = _labels(record)
    fig, (ax_u, ax_w) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [1, 1.5]})
    paper = fig_data.get("paper_utilization_existing_systems")
    if paper:
        ax_u.axhspan(paper[0], paper[1], color="0.85", label=f"paper, existing systems ({paper[0]:.1%}-{paper[1]:.1%})")
    bars = ax_u.bar(names, [r["kv_utilization"] for r in rows], color="tab:blue")
    ax_u.bar_label(bars, fmt="%.3f")
    ax_u.set_ylim(0, 1.1)
    ax_u.set_ylabel("KV utilization (tokens held / slots allocated)")
    ax_u.set_title("KV utilization, mean over steps")
    ax_u.legend(loc="upper right", fontsize=8)
    held = [tokens_held_slots(r) for r in rows]
    bottom = [h for h, _ in held]
    estimated = any(e for _, e in held)
    ax_w.bar(names, bottom, color="tab:blue", label="tokens held" + (" (estimated from utilization)" if estimated else ""))
    for (key, words), color in zip(_WASTE_KINDS, ("tab:red", "tab:orange", "tab:gray")):
        values = [r[key] for r in rows]
        ax_w.bar(names, values, bottom=bottom, color=color, label=words)
        bottom = [b + v for b, v in zip(bottom, values)]
    settings = fig_data.get("engine_settings") or {}
    if rows[0].get("num_blocks_total") and settings.get("block_size"):
        budget = rows[0]["num_blocks_total"] * settings["block_size"]
        ax_w.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"KV budget ({budget} slots)")
    ax_w.set_ylabel("token slots per step (mean)")
    ax_w.set_title("KV slots: held and wasted, by kind")
    ax_w.legend(fontsize=8, loc="upper left")
    ax_w.set_ylim(0, max(bottom + [ax_w.get_ylim()[1]]) * 1.45)
    for ax in (ax_u, ax_w):
        ax.tick_params(axis="x", labelsize=8, labelrotation=12)
    num_requests = (record.get("flags") or {}).get("num_requests")
    fig.suptitle(f"KV memory by allocator: {model}, {num_requests} {workload} requests at t=0, block "
                 f"{settings.get('block_size')}, one KV budget")
    return _save(fig, out_dir, "utilization_waste")


def timeline_steps(row: dict) -> list[int]:
    """Engine step of each batched_seqs_timeline sample: every timeline_stride-th step,
    from the first; an incomplete timeline (timeline_complete False: the engine keeps a
    bounded step log) holds the run's last steps, so it ends at num_steps."""
    stride, n = row.get("timeline_stride", 1), len(row["batched_seqs_timeline"])
    offset = 0
    if row.get("timeline_complete") is False and row.get("num_steps"):
        offset = max(row["num_steps"] - n * stride, 0)
    return [offset + i * stride for i in range(n)]


def batched_timeline(record: dict, out_dir: str) -> str:
    """benchmark_throughput: running sequences per step over the run, per allocator."""
    rows = [r for r in _ordered(record["figures"]["allocators"]) if r.get("batched_seqs_timeline")]
    if not rows:
        raise SkipPlot("no allocator row has batched_seqs_timeline (rerun experiments.benchmark_throughput)")
    plt = _pyplot()
    model, workload = _labels(record)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    partial = any(r.get("timeline_complete") is False for r in rows)
    for r in rows:
        timeline = r["batched_seqs_timeline"]
        steps = timeline_steps(r)
        mean = r.get("saturated_mean_batched_seqs") or r.get("mean_batched_seqs")
        label = f"{r['kv_allocator']} (mean {mean:.1f}{' while requests wait' if r.get('saturated_mean_batched_seqs') else ''})"
        ax.plot(steps, timeline, label=label, linewidth=1.2)
    ax.set_xlabel("engine step" + (" (only the last steps were logged)" if partial else ""))
    ax.set_ylabel("batched requests (running sequences)")
    ax.legend(fontsize=8)
    num_requests = (record.get("flags") or {}).get("num_requests")
    ax.set_title(f"Batched requests over time: {model}, {num_requests} {workload} requests at t=0", fontsize=10)
    return _save(fig, out_dir, "batched_timeline")


def latency_vs_rate(record: dict, out_dir: str, name: str = "latency_vs_rate") -> str:
    """serving_sweep: normalized latency (s/token) against request rate (paper Fig. 12)."""
    plt = _pyplot()
    fig_data = record["figures"]
    model, workload = _labels(record)
    sustained = fig_data.get("sustained_rate") or {}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for a in _ordered(fig_data["allocators"]):
        points = sorted(a["points"], key=lambda p: p["request_rate"])
        line, = ax.plot([p["request_rate"] for p in points], [p["normalized_latency_s_per_token"] for p in points],
                        marker="o", label=a["kv_allocator"])
        if sustained.get(a["kv_allocator"]) is not None:
            ax.axvline(sustained[a["kv_allocator"]], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.legend(title="dotted: highest sustained rate", fontsize=8, title_fontsize=8)
    kind = "simulated, " if fig_data.get("simulated") else ""
    ax.set_title(f"Normalized latency vs. request rate: {kind}{model}, {workload}", fontsize=10)
    return _save(fig, out_dir, name)


def block_size_sweep(record: dict, out_dir: str) -> str:
    """sweep_block_size: utilization, throughput and kernel time vs. block size; recompute
    vs. swap throughput vs. block size (paper Fig. 18/19)."""
    plt = _pyplot()
    fig_data = record["figures"]
    model, _ = _labels(record)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (("kv_utilization", "KV utilization (tokens held / slots)"),
              ("output_tokens_per_s", "throughput (output tokens/s)"), ("kernel_ms", "attention kernel time (ms)"))
    for ax, (key, ylabel) in zip(axes.flat, panels):
        for workload in dict.fromkeys(r["workload"] for r in fig_data["rows"]):
            rows = sorted((r for r in fig_data["rows"] if r["workload"] == workload), key=lambda r: r["block_size"])
            ax.plot([r["block_size"] for r in rows], [r[key] for r in rows], marker="o", label=workload)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    preemption = fig_data.get("preemption") or []
    for mode in dict.fromkeys(p["preemption_mode"] for p in preemption):
        rows = sorted((p for p in preemption if p["preemption_mode"] == mode), key=lambda p: p["block_size"])
        ax.plot([p["block_size"] for p in rows], [p["output_tokens_per_s"] for p in rows], marker="o", label=mode)
    ax.set_ylabel("throughput under preemption (output tokens/s)")
    if preemption:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no preemption rows in the record", ha="center", transform=ax.transAxes)
    from matplotlib.ticker import ScalarFormatter
    block_sizes = sorted({r["block_size"] for r in fig_data["rows"]} | {p["block_size"] for p in preemption})
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(block_sizes)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter("")
        ax.set_xlabel("block size (tokens)")
    workloads = ", ".join(dict.fromkeys(r["workload"] for r in fig_data["rows"]))
    fig.suptitle(f"Block-size sweep: {model}; workloads {workloads}")
    return _save(fig, out_dir, "block_size_sweep")


def sharing_savings(record: dict, out_dir: str) -> str:
    """sharing_savings: memory saved by sharing vs. n / beam width, with the paper's range."""
    plt = _pyplot()
    fig_data = record["figures"]
    model, workload = _labels(record)
    modes = list(dict.fromkeys(s["mode"] for s in fig_data["settings"]))
    words = {"sampling": ("parallel sampling", "parallel samples n"), "beam": ("beam search", "beam width")}
    paper = fig_data.get("paper_savings") or {}
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        settings = [s for s in fig_data["settings"] if s["mode"] == mode]
        title, xlabel = words.get(mode, (mode, "width"))
        if mode in paper:
            low, high = paper[mode]
            ax.axhspan(100 * low, 100 * high, color="0.85", label=f"paper ({100 * low:.1f}-{100 * high:.1f}%)")
        positions = list(range(len(settings)))
        bars = ax.bar(positions, [100 * s["sharing_savings"] for s in settings], color="tab:green", label="measured")
        ax.set_xticks(positions, [str(s["width"]) for s in settings])
        ax.bar_label(bars, fmt="%.1f%%")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("memory saved by sharing (% of blocks)")
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylim(0, max(100 * max(s["sharing_savings"] for s in settings), 100 * paper.get(mode, [0, 0])[1]) * 1.25)
    block = (fig_data.get("engine_settings") or {}).get("block_size")
    num_requests = (record.get("flags") or {}).get("num_requests")
    fig.suptitle(f"KV blocks saved by sharing: {model}, {num_requests} {workload} requests, block {block}")
    return _save(fig, out_dir, "sharing_savings")


def roofline(record: dict, out_dir: str, name: str = "roofline") -> str:
    """roofline: achieved GFLOP/s against arithmetic intensity (matmul FLOPs per byte read),
    one point per timed step, under each dtype's measured matmul ceiling and the
    read-bandwidth line."""
    plt = _pyplot()
    fig_data = record["figures"]
    steps = fig_data.get("steps")
    if not steps:
        raise SkipPlot("no steps in the record (rerun experiments.roofline)")
    model, _ = _labels(record)
    bandwidth = fig_data["bandwidth_gbs"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    intensities = [s["arithmetic_intensity"] for s in steps]
    lo, hi = min(intensities) / 3, max(intensities) * 3
    top = max(c["gflops"] for c in fig_data["ceilings"])
    ridge = min(max(top / bandwidth, lo), hi)  # where the bandwidth line meets the highest ceiling
    ax.plot([lo, ridge, hi], [min(bandwidth * lo, top), top, top], color="black", linewidth=1,
            label=f"read bandwidth {bandwidth:.1f} GB/s, up to the highest ceiling")
    markers = {"decode": "o", "prefill": "s"}
    for dtype, color in zip(dict.fromkeys(s["dtype"] for s in steps), ("tab:blue", "tab:orange", "tab:green")):
        mine = [s for s in steps if s["dtype"] == dtype]
        ceiling = max(c["gflops"] for c in fig_data["ceilings"] if c["dtype"] == dtype)
        ax.axhline(ceiling, color=color, linestyle="--", linewidth=1,
                   label=f"{dtype} matmul ceiling (best row count) {ceiling:.0f} GFLOP/s")
        for s in mine:
            ax.scatter(s["arithmetic_intensity"], s["achieved_gflops"], color=color, marker=markers.get(s["kind"], "x"),
                       zorder=3)
            ax.scatter(s["arithmetic_intensity"], s["ceiling_gflops"], color=color, marker="_", s=200, zorder=3)
            size = f"{s['seqs']} seqs" if s["kind"] == "decode" else f"{s['tokens']} tokens"
            ax.annotate(f"{s['kind']} {size}", (s["arithmetic_intensity"], s["achieved_gflops"]), fontsize=7,
                        xytext=(4, -10), textcoords="offset points", color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (matmul FLOPs / byte of weights + KV read)")
    ax.set_ylabel("GFLOP/s (matmul FLOPs / step time)")
    ax.legend(fontsize=7, loc="lower right", title="o decode, s prefill; - : the ceiling at the step's rows",
              title_fontsize=7)
    context = (record.get("flags") or {}).get("context_len", steps[0].get("context_len"))
    ax.set_title(f"Roofline of the served step: {model}, decode context {context} tokens", fontsize=10)
    return _save(fig, out_dir, name)


def fleet_routing(record: dict, out_dir: str, name: str = "fleet_routing") -> str:
    """fleet_routing / real_fleet_routing: per routing policy (and router, where a record
    compares routers), the fleet's prefix-cache hit rate, TTFT p50 / p90 and requests per
    replica (simulate_fleet.py's record: virtual seconds; fleet_prefix_routing.py's: real
    replicas on loopback)."""
    plt = _pyplot()
    runs, fl = record["figures"]["runs"], record.get("flags") or {}
    real = "replica_flags" in fl  # fleet_prefix_routing's flags; runs name their router by "name version"
    routers = {r["router"] for r in runs} if real else set()
    labels = [r["policy"] + (f"\n{r['router'].split()[0]}" if len(routers) > 1 else "") for r in runs]
    positions = list(range(len(runs)))
    fig, (hit_ax, ttft_ax, load_ax) = plt.subplots(1, 3, figsize=(13.5, 4.5))
    bars = hit_ax.bar(positions, [100 * r["prefix_cache_hit_rate"] for r in runs], color="tab:green")
    hit_ax.bar_label(bars, fmt="%.1f%%")
    hit_ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    hit_ax.set_ylim(0, 110)
    width = 0.38
    for offset, (key, label) in zip((-width / 2, width / 2), (("ttft_s_p50", "p50"), ("ttft_s_p90", "p90"))):
        bars = ttft_ax.bar([p + offset for p in positions], [r[key] for r in runs], width, label=label)
        ttft_ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ttft_ax.set_ylabel("time to first token (s)" if real else "time to first token (s, virtual)")
    if real:  # round-robin's queues make its TTFT 100x the others': a log axis keeps all readable
        ttft_ax.set_yscale("log")
    ttft_ax.legend(fontsize=8)
    num_replicas = len(runs[0]["requests_per_replica"])
    width = 0.8 / num_replicas
    for r_index, run in enumerate(runs):
        counts = run["requests_per_replica"]
        load_ax.bar([r_index - 0.4 + width * (i + 0.5) for i in range(num_replicas)], counts, width,
                    color=plt.cm.tab10(r_index))
    load_ax.set_ylabel("requests per replica")
    for ax in (hit_ax, ttft_ax, load_ax):
        ax.set_xticks(positions, labels, fontsize=8)
    if real:
        title = (f"{num_replicas} serve_local replicas on loopback, {fl.get('num_requests')} requests on "
                 f"{fl.get('num_prefixes')} shared system prompts (~{fl.get('prefix_words')} words) at "
                 f"{fl.get('request_rate')}/s")
    else:
        title = (f"Simulated fleet: {num_replicas} replicas, {fl.get('num_requests')} {fl.get('workload')} requests "
                 f"({fl.get('num_prefixes')} prefixes of {fl.get('prefix_len')} tokens) at {fl.get('request_rate')}/s")
    fig.suptitle(title)
    return _save(fig, out_dir, name)


# plot name -> (results file it reads, function)
PLOTS = {
    "utilization_waste": ("benchmark_throughput.json", utilization_waste),
    "batched_timeline": ("benchmark_throughput.json", batched_timeline),
    "latency_vs_rate": ("serving_sweep_kv2.json", latency_vs_rate),
    "latency_vs_rate_simulated": ("serving_sweep_simulated.json",
                                  functools.partial(latency_vs_rate, name="latency_vs_rate_simulated")),
    "block_size_sweep": ("sweep_block_size.json", block_size_sweep),
    "sharing_savings": ("sharing_savings.json", sharing_savings),
    "roofline": ("roofline.json", roofline),
    "fleet_routing": ("simulate_fleet.json", fleet_routing),
    "real_fleet_routing": ("fleet_prefix_routing_sglang.json",
                           functools.partial(fleet_routing, name="real_fleet_routing")),
}


def make_plots(results_dir: str, out_dir: str, only: list[str] | None = None) -> dict[str, str | None]:
    """Make the named plots (all by default); {name: PNG path, or None where skipped}."""
    unknown = set(only or []) - PLOTS.keys()
    if unknown:
        raise ValueError(f"unknown plot names {sorted(unknown)}; known: {sorted(PLOTS)}")
    made = {}
    for name, (filename, plot) in PLOTS.items():
        if only and name not in only:
            continue
        path = os.path.join(results_dir, filename)
        if not os.path.exists(path):
            print(f"skip {name}: {path} not found")
            made[name] = None
            continue
        with open(path) as f:
            record = json.load(f)
        try:
            made[name] = plot(record, out_dir)
        except SkipPlot as why:
            print(f"skip {name}: {filename}: {why}")
            made[name] = None
            continue
        print(f"{name}: {made[name]} ({os.path.getsize(made[name]) // 1024} KB)")
    return made


def main(argv):
    del argv
    try:
        make_plots(_RESULTS_DIR.value, _OUT_DIR.value, _ONLY.value)
    except ValueError as error:
        raise app.UsageError(str(error))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
