"""experiments/benchmarks/workloads.py: the traces have the paper's statistics and shapes."""

import numpy as np
import pytest

from experiments.benchmarks.workloads import DATASETS, Request, fluid_ratio, make_trace, trace_means


@pytest.mark.parametrize("workload", sorted(DATASETS))
def test_lengths_follow_the_data_set_means(workload):
    trace = make_trace(workload, 20000, seed=1, max_model_len=100000)
    mean_prompt, mean_output = DATASETS[workload]
    assert np.mean([len(r.prompt_token_ids) for r in trace]) == pytest.approx(mean_prompt, rel=0.03)
    assert np.mean([r.max_tokens for r in trace]) == pytest.approx(mean_output, rel=0.03)
    scaled = make_trace(workload, 20000, seed=1, scale=0.25, max_model_len=100000)
    assert np.mean([r.max_tokens for r in scaled]) == pytest.approx(mean_output * 0.25, rel=0.05)


@pytest.mark.parametrize("sigma", [0.4, 1.2])
def test_sigma_sets_the_spread_and_keeps_the_mean(sigma):
    trace = make_trace("sharegpt", 20000, seed=3, max_model_len=10**6, sigma=sigma)
    outputs = np.array([r.max_tokens for r in trace], float)
    assert np.mean(outputs) == pytest.approx(338, rel=0.04)
    # log-normal: std / mean = sqrt(exp(sigma^2) - 1); the log of the lengths has std sigma
    assert np.std(np.log(outputs)) == pytest.approx(sigma, rel=0.05)
    assert np.std(outputs) / np.mean(outputs) == pytest.approx(np.sqrt(np.expm1(sigma**2)), rel=0.15)


def test_cap_seed_and_arrivals():
    trace = make_trace("sharegpt", 3000, seed=2, max_model_len=256, request_rate=4.0, vocab_size=100)
    assert max(len(r.prompt_token_ids) + r.max_tokens for r in trace) <= 256
    assert all(3 <= t < 100 for r in trace[:50] for t in r.prompt_token_ids)
    gaps = np.diff([0.0] + [r.arrival_time for r in trace])
    assert np.all(gaps > 0) and np.mean(gaps) == pytest.approx(1 / 4.0, rel=0.06)
    assert make_trace("sharegpt", 5, seed=2) == make_trace("sharegpt", 5, seed=2)
    assert make_trace("sharegpt", 5, seed=2) != make_trace("sharegpt", 5, seed=3)
    assert all(r.arrival_time == 0 for r in make_trace("alpaca", 5))


@pytest.mark.parametrize("prefix_len", [80, 341])
def test_shared_prefix(prefix_len):
    trace = make_trace("shared-prefix", 200, seed=0, prefix_len=prefix_len, max_model_len=512)
    prefix = trace[0].prompt_token_ids[:prefix_len]
    assert all(r.prompt_token_ids[:prefix_len] == prefix for r in trace)
    suffixes = [r.prompt_token_ids[prefix_len:] for r in trace]
    assert all(len(s) >= 1 for s in suffixes) and len(set(suffixes)) == len(trace)
    assert max(len(r.prompt_token_ids) + r.max_tokens for r in trace) <= 512
    assert np.mean([len(s) for s in suffixes]) == pytest.approx(DATASETS["alpaca"][0], rel=0.2)


def test_sampling_and_beam_variants():
    assert {r.n for r in make_trace("sampling", 10, n=6)} == {6}
    assert {r.beam_width for r in make_trace("beam", 10, beam_width=2)} == {2}
    assert {(r.n, r.beam_width) for r in make_trace("alpaca", 10)} == {(1, 0)}
    with pytest.raises(ValueError, match="unknown workload"):
        make_trace("lmsys", 3)


def test_fluid_ratio_by_hand():
    # no prompts: oracle holds o, paged o / 2 on average -> 2; p = o: 2o / 1.5o = 4 / 3
    assert fluid_ratio([0, 0], [10, 30]) == pytest.approx(2.0)
    assert fluid_ratio([10, 10], [10, 10]) == pytest.approx(4 / 3)
    # weighted by output length: (1*(1+1) + 9*(1+9)) / (1*(1+0.5) + 9*(1+4.5)) = 92 / 51
    assert fluid_ratio([1, 1], [1, 9]) == pytest.approx(92 / 51)


def test_trace_means_are_the_mean_prompt_and_output_lengths():
    trace = [Request((5, 6), 3, 0.0), Request((5, 6, 7), 4, 0.0), Request((5, 6, 7, 8, 9, 10, 11), 9, 0.0)]
    assert trace_means(trace) == {"mean_prompt_tokens": 4.0, "mean_output_tokens": 16 / 3}
    assert trace_means(trace, digits=1) == {"mean_prompt_tokens": 4.0, "mean_output_tokens": 5.3}
    with pytest.raises(ValueError, match="at least one request"):
        trace_means([])
