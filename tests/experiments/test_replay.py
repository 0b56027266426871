"""experiments/benchmarks/replay.py (serving_sweep's core): the real-time replay, its figures and the sustained rate."""

import pytest

from experiments.benchmarks.replay import replay, summarize, sustained_rates
from experiments.benchmarks.workloads import make_trace
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.engine.llm_engine import LLMEngine


def test_summarize_by_hand():
    records = [  # arrival, first token, finish (s), output tokens
        {"arrival": 0.0, "first_token": 1.0, "finish": 4.0, "output_tokens": 4},  # e2e 4: 1 s/token, TPOT 1
        {"arrival": 2.0, "first_token": 2.5, "finish": 3.0, "output_tokens": 2},  # e2e 1: 0.5 s/token, TPOT 0.5
        {"arrival": 3.0, "first_token": 5.0, "finish": 5.0, "output_tokens": 1},  # e2e 2: 2 s/token, no TPOT
    ]
    s = summarize(records)
    assert s["normalized_latency_s_per_token"] == pytest.approx((1 + 0.5 + 2) / 3)
    assert s["ttft_p50_s"] == pytest.approx(1.0)  # TTFTs 1, 0.5, 2
    assert s["tpot_p50_s"] == pytest.approx(0.75)  # TPOTs 1 and 0.5
    assert s["output_tokens_per_s"] == pytest.approx(7 / 5)  # 7 tokens from t=0 to t=5
    assert s["requests_per_s"] == pytest.approx(3 / 5)


def test_sustained_rates_share_one_yardstick():
    point = lambda rate, latency: {"request_rate": rate, "normalized_latency_s_per_token": latency}
    curves = {"paged": [point(1, 0.10), point(2, 0.15), point(4, 0.5)],
              "contiguous-max": [point(1, 0.12), point(2, 0.9), point(4, 3.0)],
              "contiguous-pow2": [point(1, 0.3), point(2, 0.9)]}
    # best 0.10, factor 2: latency <= 0.2
    assert sustained_rates(curves, 2.0) == {"paged": 2, "contiguous-max": 1, "contiguous-pow2": None}


class ManualClock:
    """Virtual seconds: every reading advances 1 ms; sleeping jumps ahead."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        self.now += 0.001
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_replay_admits_requests_at_their_arrival(tiny_llama):
    clock = ManualClock()
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                                                attention_backend="reference", num_blocks=33),
                       clock=clock, final_outputs_only=True)
    trace = make_trace("alpaca", 12, seed=3, scale=0.2, max_model_len=128, vocab_size=256, request_rate=5.0)
    added = {}
    original_add = engine.add_request

    def add_request(request_id, prompt, params, *, arrival_time):
        added[request_id] = clock.now
        original_add(request_id, prompt, params, arrival_time=arrival_time)

    engine.add_request = add_request
    records = replay(engine, trace, lambda r: SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                             ignore_eos=True), clock=clock, sleep=clock.sleep)
    assert len(records) == len(trace) and not engine.has_unfinished_requests()
    assert sorted(r["output_tokens"] for r in records) == sorted(r.max_tokens for r in trace)
    assert sorted(round(r["arrival"], 6) for r in records) == sorted(round(r.arrival_time, 6) for r in trace)
    start = min(added.values()) - trace[0].arrival_time - 0.002  # the replay's start reading, within two ticks
    for request_id, at in added.items():
        arrival = trace[int(request_id)].arrival_time
        assert arrival <= at - start <= arrival + 0.05, (request_id, arrival, at - start)  # not early, not late
    for r in records:
        assert r["arrival"] <= r["first_token"] <= r["finish"]


def test_replay_ends_when_sleeping_lands_short_of_an_arrival(tiny_llama):
    """A virtual clock far from 0 cannot always land exactly on an arrival (adding 2e-15
    to 234.5 changes nothing); the replay must still admit the request and finish."""
    class ShortClock:
        def __init__(self):
            self.now, self.sleeps = 234.5007436465598, 0

        def __call__(self):
            return self.now

        def sleep(self, seconds):
            self.sleeps += 1
            assert self.sleeps < 1000, "the replay keeps sleeping without admitting the next request"
            self.now += seconds * (1 - 1e-9)  # always a little short

    clock = ShortClock()
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                                                attention_backend="reference", num_blocks=17),
                       clock=clock, final_outputs_only=True)
    trace = make_trace("alpaca", 4, seed=1, scale=0.1, max_model_len=64, vocab_size=256, request_rate=0.01)
    records = replay(engine, trace, lambda r: SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
                     clock=clock, sleep=clock.sleep)
    assert len(records) == 4
    # the engine's clock never moves while a step runs here: each request is served at its
    # (nearly reached) arrival
    assert all(r["finish"] - r["arrival"] < 1e-6 * max(1.0, r["arrival"]) + 1e-6 for r in records)
