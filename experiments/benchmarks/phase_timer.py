"""Timing a decode step's phases by wrapping an engine's parts (experiments/engine_overhead.py
says what each phase is and why it is measured); nothing in the engine is changed for it."""

from __future__ import annotations

import statistics
import time

PHASES = ("schedule", "stats", "runner_host", "device", "core_update", "outputs")


class PhaseTimer:
    """Wraps an engine's parts to time each phase of every step (engine/ is not changed)."""

    def __init__(self, engine):
        core = engine.core
        self.steps: list[dict] = []
        self._current: dict[str, float] = {}
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.stats_tracker, "record_schedule", "stats")
        self._wrap(core.stats_tracker, "record_step", "stats")
        self._wrap(core.runner, "execute", "execute")
        if callable(getattr(core.runner, "dispatch", None)):  # async scheduling's pair: the same phase
            self._wrap(core.runner, "dispatch", "execute")
            self._wrap(core.runner, "fetch", "execute")
        self._wrap(core, "step", "core_step")
        self._runner, self._engine_step = core.runner, engine.step
        engine.step = self._step

    def _wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)

    def _step(self):
        self._current = {}
        device_before = self._runner.device_seconds
        start = time.perf_counter()
        outputs = self._engine_step()
        wall = time.perf_counter() - start
        t = self._current
        device = self._runner.device_seconds - device_before
        self.steps.append({
            "wall": wall, "device": device, "schedule": t.get("schedule", 0.0), "stats": t.get("stats", 0.0),
            "runner_host": t.get("execute", 0.0) - device,
            "core_update": t.get("core_step", 0.0) - t.get("schedule", 0.0) - t.get("stats", 0.0) - t.get("execute", 0.0),
            "outputs": wall - t.get("core_step", 0.0)})
        return outputs


def decode_steps(engine, prompts, params, timer: PhaseTimer) -> list[dict]:
    """Serve one batch; the phase times of each step that decoded every sequence."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    steps, log = [], engine.stats_tracker.step_log
    while engine.has_unfinished_requests():
        logged = len(log)
        engine.step()
        if len(log) > logged and log[-1][0] == log[-1][1] == len(prompts):
            steps.append(timer.steps[-1])
    return steps


def device_step_seconds(runner, batch, iters: int = 20, repeats: int = 3) -> float:
    """The device's own time for one step of `batch`: `iters` steps dispatched back to back
    (the device's queue never empties, so no host time is in between), over iters; the
    lowest of `repeats` such runs (other work only slows one down). A batch the engine ran
    (`ModelRunner.dispatch(...).batch`), run again after the engine is idle: it rewrites K/V
    in free blocks only. On a CPU the dispatching itself runs on the cores the step uses, so
    this is an upper bound of the step's own time."""
    import jax

    jax.block_until_ready(runner._launch(batch, None))  # noqa: SLF001 (the runner's dispatch, no host work)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            result = runner._launch(batch, None)
        jax.block_until_ready(result)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def summarize(steps: list[dict]) -> dict:
    """Median ms per phase, host total and the device's idle fraction over `steps`."""
    ms = {phase: round(1e3 * statistics.median(s[phase] for s in steps), 3) for phase in PHASES}
    wall = statistics.median(s["wall"] for s in steps)
    host = statistics.median(s["wall"] - s["device"] for s in steps)
    return {"phases_ms": ms, "wall_ms": round(1e3 * wall, 3), "host_ms": round(1e3 * host, 3),
            "device_idle_fraction": round(statistics.median((s["wall"] - s["device"]) / s["wall"] for s in steps), 4),
            "decode_steps": len(steps)}
