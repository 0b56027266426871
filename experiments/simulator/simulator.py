"""The simulator's engine: the real LLMEngine with a model-free runner on a virtual clock.

The runner samples a fixed token per scheduled row and advances the clock by a step-time
model (step_time_model.py); everything else (scheduler, block manager or contiguous
allocator, stop checks, outputs, stats) is the engine's own code, so the schedule is the
real engine's step for step (tests/experiments/test_simulate.py checks it).
`python -m experiments.simulate` is the entry point over this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
import time

import numpy as np

from experiments.simulator.fast_forward import FastForward
from experiments.simulator.step_time_model import StepTimeModel, step_features
from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.entrypoints.allocators import make_allocator
from paged_jax.loading import LoadedModel
from paged_jax.worker.kv_cache import bytes_per_block
from paged_jax.worker.model_runner import StepResult

SIMULATED_TOKEN_ID = 3  # what the model-free runner "samples": any id that is no stop token works


class VirtualClock:
    """Seconds of simulated time; the engine reads it where it would read time.monotonic."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimulatedRunner:
    """ModelRunner's interface without a model: each step samples SIMULATED_TOKEN_ID for
    every row and advances the clock by the step-time model's time for the step. No
    device time is spent (device_seconds stays 0); swaps cost nothing in the model."""

    num_compilations = 0

    def __init__(self, model_config, params, config: EngineConfig, *, num_blocks: int, num_host_blocks: int,
                 step_model: StepTimeModel, clock: VirtualClock):
        del params, num_blocks, num_host_blocks
        self.num_top_logprobs = min(config.max_logprobs, model_config.vocab_size)
        self.device_seconds = 0.0
        self._model, self._clock = step_model, clock
        self._buckets = (config.seq_buckets, config.token_buckets) if step_model.bucketed else ()

    def warm_up(self, progress: bool = False) -> None:  # nothing compiles: no bar to show
        """Nothing to compile."""

    def execute(self, output, seqs) -> StepResult:
        del seqs
        self._clock.now += self._model.seconds(*step_features(output, *self._buckets))
        n = len(output.chunks)
        return StepResult([SIMULATED_TOKEN_ID] * n, [0.0] * n, None, None)


@dataclasses.dataclass(frozen=True)
class RequestTimes:
    arrival: float
    first_token: float
    finish: float
    num_output_tokens: int


class Simulator:
    """One simulated engine over one trace (requests sorted by arrival time).

    `engine` is a real LLMEngine (`model_config` gives it a vocabulary and KV layout, no
    weights); `times` fills with each finished request's virtual times.
    """

    def __init__(self, trace, config: EngineConfig, step_model: StepTimeModel, model_config, *,
                 fast_forward: bool = True):
        """`fast_forward`: every step that cannot finish a request without engine.step()
        (fast_forward.py: the same schedule, state and figures for a fraction of the
        Python); False: every step through engine.step() (what a test logging each
        schedule needs)."""
        if any(b.arrival_time < a.arrival_time for a, b in itertools.pairwise(trace)):
            raise ValueError("the trace must be sorted by arrival time")
        self.trace = trace
        make_engine, self.clock, _ = simulated_serving(model_config, step_model)
        self.engine = make_engine(config)
        self.times: dict[int, RequestTimes] = {}  # trace index -> times, filled as requests finish
        core = self.engine.core
        buckets = (core.config.seq_buckets, core.config.token_buckets) if step_model.bucketed else ()
        self.fast_forward = (FastForward(self.engine, self.clock, step_model, SIMULATED_TOKEN_ID, buckets)
                             if fast_forward else None)

    def run(self, progress=None) -> dict:
        """Serve the whole trace; returns the engine's stats plus latency and throughput
        figures on the virtual clock and the wall seconds spent. `progress(n)` is called
        with the number of requests that finished in each step. wall_seconds and
        cpu_seconds (this process) time the simulation itself: on a shared machine the CPU
        time is the steadier figure."""
        with cyclic_gc_paused():
            return self._run(progress)

    def _run(self, progress) -> dict:
        engine, clock, trace = self.engine, self.clock, self.trace
        start, cpu_start = time.perf_counter(), time.process_time()
        next_index = 0
        while next_index < len(trace) or engine.has_unfinished_requests():
            while next_index < len(trace) and trace[next_index].arrival_time <= clock.now:
                request = trace[next_index]
                engine.add_request(str(next_index), {"prompt_token_ids": request.prompt_token_ids},
                                   greedy_params(request.max_tokens), arrival_time=request.arrival_time,
                                   priority=request.priority)
                next_index += 1
            if not engine.has_unfinished_requests():  # idle until the next arrival
                clock.now = trace[next_index].arrival_time
                continue
            if self.fast_forward is not None:  # the steps before the next arrival, if it can
                next_arrival = trace[next_index].arrival_time if next_index < len(trace) else math.inf
                record_finished(self.fast_forward.advance(next_arrival, progress), self.times)
                if self.fast_forward.num_last_applied:
                    continue
            finished = record_finished(engine.step(), self.times)
            if progress is not None and finished:
                progress(finished)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        return {**engine.stats(), **latency_figures(list(self.times.values())), "wall_seconds": wall,
                "cpu_seconds": cpu}


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause CPython's cyclic garbage collector for a simulation, and collect once after.

    Why: a simulation allocates millions of short-lived objects beside a heap of up to
    100k queued requests, and the collector's generation scans rescan that heap again and
    again (a quarter of the wall time at 100k requests on one engine), while the engine's
    bookkeeping leaves almost no cyclic garbage (reference counting frees the rest)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


@functools.lru_cache(maxsize=None)
def budget_num_blocks(model_config, block_size: int, kv_cache_memory_bytes: int | None = None) -> int:
    """KV blocks (incl. the null block) that a float32 cache of `kv_cache_memory_bytes` holds
    (None: the engine's default budget): the simulator has no device to size its cache from,
    so every simulating script gives its engines the blocks the real engine's budget buys."""
    budget = kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
    return budget // bytes_per_block(model_config, block_size, "float32")


def greedy_params(max_tokens: int) -> SamplingParams:
    """A simulated request's sampling parameters (greedy, EOS ignored): one frozen object
    per output length, shared by its requests, instead of one validated per request."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def record_finished(outputs, times: dict) -> int:
    """Put each finished request's virtual times into `times` (trace index -> RequestTimes);
    returns how many finished."""
    finished = 0
    for out in outputs:
        if out.finished:
            metrics = out.metrics
            times[int(out.request_id)] = RequestTimes(metrics["arrival_time"], metrics["first_token_time"],
                                                      metrics["finish_time"], len(out.outputs[0].token_ids))
            finished += 1
    return finished


def simulated_serving(model_config, step_model: StepTimeModel):
    """(make_engine(config), clock, sleep) for running engines in virtual time (the
    Simulator; experiments/benchmarks/replay.py under serving_sweep --simulate): one VirtualClock
    shared by the driver, the engines' metrics and their SimulatedRunners; `sleep`
    advances it. `model_config` gives a vocabulary and KV layout, no weights."""
    model = LoadedModel(model_config, None, None, "simulated", "none", 0.0)
    clock = VirtualClock()

    def make_engine(config: EngineConfig) -> LLMEngine:
        factory = functools.partial(SimulatedRunner, step_model=step_model, clock=clock)
        return LLMEngine(model, config, runner_factory=factory, clock=clock, final_outputs_only=True,
                         allocator_factory=make_allocator)  # kv_allocator may name one of the paper's baselines

    def sleep(seconds: float) -> None:
        clock.now += max(0.0, seconds)

    return make_engine, clock, sleep


def _percentiles(values, name: str) -> dict:
    if not values:
        return {f"{name}_p{q}": None for q in (50, 90, 99)}
    return {f"{name}_p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def latency_figures(times: list[RequestTimes]) -> dict:
    """Per-request latency on the virtual clock, summarized:

    - normalized latency: (finish - arrival) / output tokens, mean over requests (the
      paper's serving metric, Fig. 12);
    - TTFT: first token - arrival; TPOT: (finish - first token) / (output tokens - 1),
      over requests with at least two output tokens;
    - throughput: requests and output tokens per second between the first arrival and
      the last finish.
    """
    if not times:
        return {"num_requests": 0}
    normalized = [(t.finish - t.arrival) / t.num_output_tokens for t in times]
    ttft = [t.first_token - t.arrival for t in times]
    tpot = [(t.finish - t.first_token) / (t.num_output_tokens - 1) for t in times if t.num_output_tokens > 1]
    duration = max(t.finish for t in times) - min(t.arrival for t in times)
    output_tokens = sum(t.num_output_tokens for t in times)
    return {
        "num_requests": len(times), "output_tokens": output_tokens, "virtual_seconds": duration,
        "requests_per_s": len(times) / duration if duration > 0 else math.inf,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else math.inf,
        "mean_normalized_latency_s": float(np.mean(normalized)),
        **_percentiles(ttft, "ttft_s"), **_percentiles(tpot, "tpot_s"),
    }
