"""Results-table rows (docs/results.md) of experiments/gpu_bench.py's records: the engine's offline
throughput on an accelerator with its defaults, the decode step beside the device's busy time and
its memory-bandwidth roofline, and transformers' continuous batching on the same trace."""

from __future__ import annotations

from experiments.reporting.results_rows import _cpu_note, model_label, workload_label


def _trace(fig: dict) -> str:
    return (f"{fig['num_requests']} {workload_label(fig.get('workload'))} requests (mean prompt "
            f"{fig['mean_prompt_tokens']:.0f}, output {fig['mean_output_tokens']:.0f})")


def gpu_bench(record: dict) -> list:
    fig, note = record["figures"], _cpu_note(record)
    if fig.get("engine") == "hf_continuous":
        hf = fig.get("hf_continuous") or {}
        figure = (f"transformers continuous batching, {fig.get('preset')}'s shapes ({fig['dtype']}), {_trace(fig)}, "
                  "output tok/s; paged_jax / transformers")
        if "error" in hf:
            return [(figure, f"failed: {hf['error'][:120]}{note}")]
        if "output_tokens_per_s" not in hf:  # the stage stopped before transformers finished
            return [(figure, f"not measured (the run stopped){note}")]
        against = fig.get("against") or {}
        ratio = (f"{against['throughput_ratio']}x" + ("" if against.get("same_trace") else " (a different trace)")
                 if "throughput_ratio" in against else "no paged_jax record to compare")
        return [(figure, f"{hf['output_tokens_per_s']:.0f}; {ratio}{note}")]
    if "output_tokens_per_s" not in fig:  # the stage stopped before its trace finished
        return [(f"offline output tok/s, {model_label(fig.get('model'))}", f"not measured (the run stopped){note}")]
    s = fig["engine_settings"]
    rows = [(f"offline output tok/s, {model_label(fig['model'])} ({fig['dtype']}), {_trace(fig)}, the platform's "
             f"defaults: {s['max_num_seqs']} sequences / {s['max_num_batched_tokens']} tokens per step "
             f"({s['num_step_programs']} step programs), {s['num_blocks']} KV blocks of {s['block_size']}, async "
             f"scheduling {'on' if s['async_scheduling'] else 'off'}",
             f"{fig['output_tokens_per_s']:.0f} (start-up {fig['setup_s']:.0f} s){note}")]
    window = fig.get("decode_window")
    if window:
        roof = window["roofline"]
        busy = window.get("device_busy_fraction")
        rows.append((f"same, a decode step of {window['num_seqs']} sequences at mean context "
                     f"{window['mean_context']:.0f}: wall ms; device busy (profiler trace); roofline ms "
                     "(weights + K/V bytes over measured bandwidth, or matmul FLOPs over measured rate)",
                     f"{window['wall_ms_per_step']:.3g}; "
                     + (f"{busy:.0%}" if busy is not None else "unavailable") + f"; {roof['roofline_ms']:.3g} "
                     f"({roof['bound']}-bound: {window['step_over_roofline']}x it, "
                     f"{roof['roofline_output_tokens_per_s']:.0f} tok/s at it){note}"))
        phases = (window.get("host_phases") or {}).get("phases_ms")
        if phases:
            names = [p for p in ("schedule", "stats", "runner_host", "core_update", "outputs") if p in phases]
            rows.append(("same decode step, the host's ms per step outside device calls: "
                         + " / ".join(p.replace("_", " ") for p in names),
                         " / ".join(f"{phases[p]:.3g}" for p in names)
                         + f" ({window['host_phases']['host_ms']:.3g} in all){note}"))
    return rows
