"""The fleet simulator (experiments/simulator/fleet.py) and its routers (routing.py).

One replica must be the single-engine Simulator step for step (same request times and
stats, whatever the policy); several replicas must give the same results with and
without the fast-forward (routing sees the same states); and each router must make
the choice its rule names on inputs small enough to check by hand.
"""


import pytest

import configs
from experiments.benchmarks.workloads import make_trace
from experiments.simulator.fleet import FleetSimulator
from experiments.simulator.routing import LeastLoaded, PrefixAware, RoundRobin, block_chain, make_router
from experiments.simulator.simulator import Simulator
from experiments.simulator.step_time_model import StepTimeModel
from paged_jax.config.engine_config import EngineConfig

STEP_MODEL = StepTimeModel(intercept_s=0.01, per_token_s=0.002, per_seq_s=0.003, per_context_token_s=1e-4)
CONFIG = EngineConfig(block_size=4, max_model_len=128, max_num_seqs=6, max_num_batched_tokens=32, num_blocks=48,
                      enable_prefix_caching=True, attention_backend="reference")
IGNORED = {"host_seconds_per_step", "host_fraction", "saturated_tokens_per_s", "wall_seconds", "cpu_seconds"}


@pytest.fixture(scope="module")
def trace():
    return make_trace("system-prompts", 60, seed=2, scale=0.5, max_model_len=128, vocab_size=256,
                      request_rate=8.0, prefix_len=24, num_prefixes=4)


def test_the_system_prompts_workload_puts_one_of_k_prefixes_first(trace):
    prefixes = {r.prompt_token_ids[:24] for r in trace}
    assert len(prefixes) == 4
    assert all(len(r.prompt_token_ids) > 24 for r in trace)


@pytest.mark.parametrize("policy", ["round-robin", "prefix-aware"])
def test_one_replica_is_the_single_engine_simulator(trace, policy):
    model_config = configs.get_config("tiny_llama")
    single = Simulator(trace, CONFIG, STEP_MODEL, model_config)
    single_figures = single.run()
    fleet = FleetSimulator(trace, CONFIG, STEP_MODEL, model_config, num_replicas=1,
                           router=make_router(policy, 1, CONFIG.block_size))
    fleet_figures = fleet.run()
    assert fleet.times == single.times and len(single.times) == len(trace)
    stats = fleet.replicas[0].engine.stats()
    for key, value in single.engine.stats().items():
        if key not in IGNORED:
            assert stats[key] == value, key
    assert fleet_figures["prefix_cache_hit_tokens"] == single_figures["prefix_cache_hit_tokens"] > 0


def test_fast_forward_changes_nothing_across_replicas(trace):
    model_config = configs.get_config("tiny_llama")
    runs = []
    for fast in (False, True):
        fleet = FleetSimulator(trace, CONFIG, STEP_MODEL, model_config, num_replicas=3,
                               router=make_router("prefix-aware", 3, CONFIG.block_size, balance_abs=2),
                               fast_forward=fast)
        figures = fleet.run()
        runs.append((fleet, figures))
    (slow, slow_figures), (fast, fast_figures) = runs
    assert fast.replicas[0].fast_forward.num_steps > 0
    assert fast.assignment == slow.assignment and len(set(slow.assignment)) == 3
    assert fast.times == slow.times
    assert all(r.in_flight == 0 for r in slow.replicas + fast.replicas)  # every finish reached the router's view
    assert sum(slow_figures["requests_per_replica"]) == len(trace)
    for key in ("prefix_cache_hit_tokens", "num_steps", "num_preemptions", "requests_per_replica", "ttft_s_p50"):
        assert fast_figures[key] == slow_figures[key], key


def test_round_robin_and_least_loaded():
    rr = RoundRobin(3)
    assert [rr.choose((), [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = LeastLoaded(3)
    assert ll.choose((), [2, 1, 3]) == 1
    assert [ll.choose((), [0, 0, 0]) for _ in range(3)] == [2, 0, 1]  # ties rotate from after the last choice


def test_prefix_aware_follows_the_prefix_unless_load_is_imbalanced():
    router = PrefixAware(3, 4, balance_abs=4)
    a, b = list(range(100, 120)), list(range(200, 220))  # 5 blocks each
    first = router.choose(a, [0, 0, 0])
    assert first == 0  # nothing matches: the smallest tree (ties: least loaded, lowest index)
    assert router.choose(b, [1, 0, 0]) == 1  # b matches nothing: the smallest tree again
    assert router.choose(a[:16] + [7, 7, 7, 7], [1, 1, 0]) == 0  # 4 of 5 blocks cached on 0: > half
    assert router.choose(a[:4] + [9] * 16, [2, 1, 0]) == 2  # 1 of 5 blocks: below the threshold, spread
    assert router.choose(a, [9, 1, 1]) in (1, 2)  # 9 - 1 > 4 and 9 > 1.0001: least loaded wins over the cache
    assert router.stats() == {"cache_routed": 1, "balance_routed": 1, "spread_routed": 3}


def test_block_chain_keys_name_the_whole_prefix():
    x = block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    y = block_chain([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(x) == 2 and len(y) == 2 and x[1] != y[1]  # same second block, different first
    assert block_chain([1, 2, 3], 4) == []
