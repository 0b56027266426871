"""A simulated fleet: N replicas of the simulated engine behind a router, one event loop.

Each replica is the simulator's engine (simulator.py: the real scheduler and block
manager, a model-free runner, its own virtual clock advanced by the step-time model)
and runs on its own device, so replicas step independently. One loop keeps them in
order of time: the next event is either the next arrival or the step of the busy
replica whose clock is earliest. An arrival is routed (routing.py) with what a router
knows then, the prompt and each replica's requests in flight, and joins that replica's
waiting queue; an idle replica's clock jumps to it, a busy one sees it at its next
step, as a real engine does. A replica's state at an arrival is the one after its last
step that started before it; fast-forwarded steps (fast_forward.py) stop at every
arrival, so routing sees the same states with or without them.

With one replica and any policy this is the single-engine Simulator, step for step
(tests/experiments/test_fleet.py checks it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np

from experiments.simulator.fast_forward import FastForward
from experiments.simulator.simulator import (SIMULATED_TOKEN_ID, RequestTimes, cyclic_gc_paused, greedy_params,
                                            latency_figures, record_finished, simulated_serving)


@dataclasses.dataclass
class Replica:
    engine: object  # LLMEngine over a SimulatedRunner
    clock: object  # its VirtualClock
    fast_forward: FastForward | None
    in_flight: int = 0  # requests routed here and not finished (the router's view)
    num_routed: int = 0


class FleetSimulator:
    def __init__(self, trace, config, step_model, model_config, *, num_replicas: int, router,
                 fast_forward: bool = True):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if any(b.arrival_time < a.arrival_time for a, b in itertools.pairwise(trace)):
            raise ValueError("the trace must be sorted by arrival time")
        self.trace, self.router = trace, router
        self.replicas = []
        for _ in range(num_replicas):
            make_engine, clock, _ = simulated_serving(model_config, step_model)
            engine = make_engine(config)
            core = engine.core
            buckets = (core.config.seq_buckets, core.config.token_buckets) if step_model.bucketed else ()
            ff = FastForward(engine, clock, step_model, SIMULATED_TOKEN_ID, buckets) if fast_forward else None
            self.replicas.append(Replica(engine, clock, ff))
        self.times: dict[int, RequestTimes] = {}
        self.assignment: list[int] = []  # trace index -> replica

    def run(self, progress=None) -> dict:
        """Serve the trace; returns fleet figures (fleet_figures) plus wall and CPU seconds."""
        with cyclic_gc_paused():
            return self._run(progress)

    def _run(self, progress) -> dict:
        trace, replicas = self.trace, self.replicas
        start, cpu_start = time.perf_counter(), time.process_time()
        next_index = 0
        while True:
            arrival = trace[next_index].arrival_time if next_index < len(trace) else math.inf
            busy = [r for r in replicas if r.engine.has_unfinished_requests()]
            replica = min(busy, key=lambda r: r.clock.now) if busy else None
            if replica is None and arrival == math.inf:
                break
            if replica is None or arrival <= replica.clock.now:
                self._route(next_index)
                next_index += 1
                continue
            ff = replica.fast_forward
            if ff is not None:  # the replica's steps before the next arrival, if it can
                finished = record_finished(ff.advance(arrival, progress), self.times)
                replica.in_flight -= finished
                if ff.num_last_applied:
                    continue
            finished = record_finished(replica.engine.step(), self.times)
            if progress is not None and finished:
                progress(finished)
            replica.in_flight -= finished
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        return {**fleet_figures(self), "wall_seconds": wall, "cpu_seconds": cpu}

    def _route(self, index: int) -> None:
        request = self.trace[index]
        choice = self.router.choose(request.prompt_token_ids, [r.in_flight for r in self.replicas])
        replica = self.replicas[choice]
        if not replica.engine.has_unfinished_requests():  # idle: it starts when the request arrives
            replica.clock.now = max(replica.clock.now, request.arrival_time)
        replica.engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids},
                                   greedy_params(request.max_tokens), arrival_time=request.arrival_time,
                                   priority=request.priority)
        replica.in_flight += 1
        replica.num_routed += 1
        self.assignment.append(choice)


def fleet_figures(fleet: FleetSimulator) -> dict:
    """Latency and throughput over all requests (latency_figures), the prefix-cache hit
    rate over the fleet (hit tokens / looked-up tokens, summed), and balance: requests
    per replica and the largest relative deviation from their mean."""
    stats = [r.engine.stats() for r in fleet.replicas]
    query = sum(s["prefix_cache_query_tokens"] for s in stats)
    hits = sum(s["prefix_cache_hit_tokens"] for s in stats)
    counts = [r.num_routed for r in fleet.replicas]
    mean = float(np.mean(counts))
    router_stats = fleet.router.stats() if hasattr(fleet.router, "stats") else {}
    return {
        **latency_figures(list(fleet.times.values())),
        "num_replicas": len(fleet.replicas),
        "prefix_cache_hit_rate": hits / query if query else 0.0,
        "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": query,
        "requests_per_replica": counts,
        "max_load_deviation": max(abs(c - mean) for c in counts) / mean if mean else 0.0,
        "num_steps": sum(s["num_steps"] for s in stats),
        "num_preemptions": sum(s["num_preemptions"] for s in stats),
        "num_prefix_cache_evictions": sum(s["num_prefix_cache_evictions"] for s in stats),
        "mean_batched_seqs": float(np.mean([s["mean_batched_seqs"] for s in stats])),
        "router": router_stats,
    }
