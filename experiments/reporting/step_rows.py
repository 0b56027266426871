"""Results-table rows (docs/results.md) of the step-cost records: a decode step by part (step_profile), by KV pool
size (step_time_vs_cache_size), by padded shape (step_shape_costs), the host's share
late in long outputs (host_time_vs_output_len), and with or without the native kernels'
spinning helper threads (helper_threads).

Split from results_rows.py (which imports these into its BUILDERS after defining the
shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

import itertools

from experiments.reporting import results_rows as rr


def step_profile(record: dict) -> list:
    """Parts of a decode step by batch size, against the matmul ceiling."""
    fig = record["figures"]
    rows = fig["rows"]
    batches = " / ".join(str(r["num_seqs"]) for r in rows)
    parts = list(rows[0]["parts_ms"])
    value = "; ".join(f"{r['num_seqs']}: " + ", ".join(f"{r['parts_ms'][k]:.0f}" for k in parts)
                      + f" ms (step before {r['tokens_per_s_before']:.0f} / after {r['tokens_per_s_after']:.0f} tok/s"
                      f", ceiling {r['ceiling_tokens_per_s']:.0f})" for r in rows)
    return [(f"decode step by part, {rr._setting(record)}, {rows[0].get('dtype', 'float32')}, context "
             f"{rows[0]['context_len']}, batch {batches}: " + ", ".join(parts)
             + " ms; tok/s of the step before and after the native kernels (after: an all-greedy batch, its "
               "tokens the served head's argmax where the head is packed, else greedy_head's), and if every "
               "matmul ran at the fastest matmul's rate at the batch's rows (weights from memory)", value)]


def step_time_vs_cache_size(record: dict) -> list:
    """Median decode step time at one batch for several KV pool sizes."""
    fig = record["figures"]
    rows = fig["rows"]
    return [(f"decode step of {fig['num_seqs']} sequences, {rr._setting(record)}, by KV pool size: "
             + " / ".join(f"{r['num_blocks']} blocks" for r in rows),
             " / ".join(f"{r['device_ms_median']:.1f} ms" for r in rows))]


def step_shape_costs(record: dict) -> list:
    """A jitted step per padded shape, and the copy-on-write call on a padded list."""
    fig = record["figures"]
    steps = fig["steps"]
    return [(f"step on padding-only batches, {rr._setting(record)}, {fig['num_blocks']} blocks, by padded rows "
             + " / ".join(str(r["rows"]) for r in steps) + f"; block-copy call on {fig['copy_padded_entries']} "
             "padded entries", " / ".join(f"{r['step_ms']:.0f} ms" for r in steps) + f"; {fig['copy_ms']:.0f} ms")]


def host_time_vs_output_len(record: dict) -> list:
    """Host milliseconds per decode step early and late in long outputs, per output kind
    (and the engine core's part, where the record has it). Records from before the output
    kinds name two modes by `final_outputs_only`: per-step (cumulative) and final outputs."""
    fig = record["figures"]
    modes = {"cumulative": "per-step cumulative outputs", "delta": "per-step delta outputs",
             "final_only": "final outputs only"}
    out = []
    for runner, kind in itertools.product(("model", "host_only"), modes):
        rows = [r for r in fig["rows"] if r.get("runner", "model") == runner
                and r.get("output_kind", "final_only" if r["final_outputs_only"] else "cumulative") == kind]
        if not rows:
            continue
        mode = modes[kind] if any("output_kind" in r for r in rows) else (
            "final outputs only" if kind == "final_only" else "per-step outputs")
        if runner == "host_only":
            mode += ", host-only runner (no device step)"
        core = all("core_host_ms_median_first_64" in r for r in rows)
        out.append((f"host time per decode step, {fig['num_seqs']} sequences, {mode}, outputs "
                    + " / ".join(str(r["output_len"]) for r in rows) + " tokens: first 64 -> last 64 steps"
                    + (" (engine core's part)" if core else ""),
                    " / ".join(f"{r['host_ms_median_first_64']:.2f} -> {r['host_ms_median_last_64']:.2f} ms "
                               + (f"({r['core_host_ms_median_first_64']:.2f} -> {r['core_host_ms_median_last_64']:.2f}"
                                  f" ms) " if core else "")
                               + (f"(device {r['device_ms_median']:.0f} ms)" if runner == "model" else "")
                               for r in rows)))
    return out


def helper_threads(record: dict) -> list:
    """Served step times per helper spin window (the first the baseline), with the
    speedups as medians of the rounds' ratios."""
    fig, flags = record["figures"], record["flags"]
    steps = fig["steps"]
    windows = [int(w) for w in flags["spin_us"]]
    words = " / ".join("XLA's pool" if w == 0 else f"{w} us" for w in windows)
    value = "; ".join(
        f"{s['dtype']} {s['kind']} {s['seqs'] if s['kind'] == 'decode' else s['tokens']}: "
        + " / ".join(f"{s['windows'][str(w)]['step_ms']:.1f}" for w in windows) + " ms"
        + "".join(f" ({s['windows'][str(w)]['speedup']:.2f}x)" for w in windows[1:]) for s in steps)
    return [(f"served step by the native kernels' helper threads, {rr.model_label(fig.get('model'))}, decode at "
             f"{flags.get('context_len')} context tokens and prefill chunks, {flags.get('rounds')} alternating rounds: "
             f"step ms with {words} (speedup over the first, median of the rounds' ratios)",
             value + rr._cpu_note(record))]


def engine_overhead(record: dict) -> list:
    """A decode step's host time with the paper's metrics off (the serving default) and on,
    per runner, with the stats phase that the switch changes and the device's idle share; and
    the model's step with async scheduling off and on (its wall time, the device's idle share
    estimated from the device's own step time)."""
    fig = record["figures"]
    rows = {(r["runner"], r["paper_metrics"]): r for r in fig["rows"] if not r.get("async_scheduling")}
    out = []
    for runner in ("model", "host_only"):
        off, on = rows.get((runner, False)), rows.get((runner, True))
        if off is None or on is None:
            continue
        what = "with the model's step" if runner == "model" else "host-only runner"
        value = (f"{off['host_ms']:.3f} / {on['host_ms']:.3f} ms (stats {off['phases_ms']['stats']:.3f} / "
                 f"{on['phases_ms']['stats']:.3f} ms)")
        if runner == "model":
            value += f"; device idle {100 * off['device_idle_fraction']:.1f}% of the step"
        out.append((f"{fig['model']}: host time of a {fig['num_seqs']}-sequence decode step ({what}), paper metrics "
                    f"off / on{rr._cpu_note(record)}", value))
    by_async = {r.get("async_scheduling", False): r for r in fig["rows"]
                if r["runner"] == "model" and not r["paper_metrics"] and "device_step_ms" in r}
    if len(by_async) == 2:
        off, on = by_async[False], by_async[True]
        out.append((f"{fig['model']}: a {fig['num_seqs']}-sequence decode step with the model, async scheduling "
                    f"off / on{rr._cpu_note(record)}",
                    f"{off['wall_ms']:.3f} / {on['wall_ms']:.3f} ms (device's own step {off['device_step_ms']:.3f} / "
                    f"{on['device_step_ms']:.3f} ms; device idle {100 * off['device_idle_estimate']:.1f}% / "
                    f"{100 * on['device_idle_estimate']:.1f}%)"))
    return out
