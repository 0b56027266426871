"""How busy the device is during decode, read from a JAX profiler trace (experiments/gpu_bench.py).

Why a trace: the engine's own timers measure the host (its device seconds are time spent
waiting inside jitted calls, which with async scheduling no longer equals the device's own
time), so "is the accelerator idle between steps" can only be answered by the device's
record of what it ran. `jax.profiler.trace` writes an XSpace (`*.xplane.pb`) whose device
planes (`/device:GPU:0`, ...) hold one line per CUDA stream ("Stream #N(...)"), each event a
kernel or copy with its start and duration on the device; `jax.profiler.ProfileData` reads
it. The device is busy where any stream runs something (a kernel, or a copy: a step's inputs
are a few KB, microseconds): the union of those intervals, so
that concurrent streams are not counted twice. The derived lines ("XLA Modules", "XLA
Ops", "Steps") are not used: a module's event spans its kernels and the gaps between them.
Where a device plane has no stream lines (TPU), its "XLA Ops" line is used, and the
record says which lines it used.

On a CPU there is no device plane (the step runs on the host's own threads): the result
then says "unavailable" and lists the planes the trace had, rather than a figure.
"""

from __future__ import annotations

import glob
import os
import time

DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source", "Framework")


def union_ns(intervals) -> float:
    """Total length of the union of (start, end) intervals: time covered by at least one."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def device_lines(plane) -> tuple[list, str]:
    """(lines, which) of a device plane: its stream lines (GPU), else its "XLA Ops" line."""
    streams = [line for line in plane.lines if line.name.startswith("Stream")]
    if streams:
        return streams, "streams"
    ops = [line for line in plane.lines if line.name == "XLA Ops"]
    return ops, "XLA Ops"


def device_busy(planes) -> dict:
    """Busy device time in the trace's planes: {"available": True, "busy_ms", "span_ms" (first
    event start to last event end), "num_events", "device_planes", "lines"}, the least busy
    device's where there are several; or {"available": False, "reason"}."""
    planes = list(planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    if not devices:
        return {"available": False,
                "reason": "the trace has no device plane (planes: " + ", ".join(p.name for p in planes)
                          + "): on a CPU the step runs on the host's threads, not on a device with its own timeline"}
    per_device = []
    for plane in devices:
        lines, which = device_lines(plane)
        intervals = [(e.start_ns, e.end_ns) for line in lines for e in line.events if e.end_ns > e.start_ns]
        if intervals:
            per_device.append((union_ns(intervals), plane.name, which, [line.name for line in lines], intervals))
    if not per_device:
        lines = "; ".join(f"{p.name}: {[line.name for line in p.lines]}" for p in devices)
        return {"available": False,
                "reason": f"the device planes hold no events on their stream or XLA Ops lines (their lines: {lines})"}
    busy, name, which, names, intervals = min(per_device)
    return {"available": True, "busy_ms": busy / 1e6,
            "span_ms": (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e6,
            "num_events": len(intervals), "device_plane": name, "lines_used": which, "lines": names[:8]}


def traced_device_busy(run, log_dir: str) -> tuple[float, dict]:
    """(wall seconds of `run()`, device_busy of the trace taken around it). The Python tracer
    is off (it would slow the host, the thing whose cost is in question); the host tracer
    stays at its lowest level."""
    import jax
    from jax.profiler import ProfileData
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    before = set(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
    with jax.profiler.trace(log_dir, profiler_options=options):
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    written = sorted(set(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)) - before)
    if not written:
        return wall, {"available": False, "reason": f"the profiler wrote no .xplane.pb under {log_dir}"}
    return wall, device_busy(ProfileData.from_file(written[-1]).planes)
