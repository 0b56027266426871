"""experiments/peer_vllm.py's figures, without vLLM: tok/s, the greedy comparison, the results-table row.

The comparison with vLLM is only worth its ratio if every output is compared and a
difference passes only at a checked near-tie; these run the pure functions of
experiments/benchmarks/vllm_worker.py (peer_vllm.py itself is not imported: its absl flags
clash with experiments/peer_hf.py's in one test process) on made-up outputs and logits.
"""

import numpy as np
import pytest

from experiments.benchmarks.vllm_worker import (
    compare_outputs,
    first_difference,
    sparse_logits,
    summarize,
    throughput,
    tie_queries,
    wrong_lengths,
)
from tests.helpers.row_numbers import numbers, shows_in_order

from experiments.reporting import results_rows

PROMPTS = [[5, 6], [7], [8, 9, 10]]
REFERENCE = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_throughput_counts_useful_tokens_per_second():
    assert throughput(4, 300, 2.0) == {"wall_s": 2.0, "requests_per_s": 2.0, "output_tokens_per_s": 150.0,
                                       "useful_output_tokens": 300}
    with pytest.raises(ValueError):
        throughput(4, 300, 0.0)


def test_summarize_ratios_per_mode_and_round():
    runs = [{"system": "vllm", "mode": "both_cores", "output_tokens_per_s": 100.0},
            {"system": "vllm", "mode": "default", "output_tokens_per_s": 50.0},
            {"system": "paged_jax", "mode": "paged_jax", "output_tokens_per_s": 150.0},
            {"system": "vllm", "mode": "both_cores", "output_tokens_per_s": 300.0},
            {"system": "vllm", "mode": "default", "output_tokens_per_s": 50.0},
            {"system": "paged_jax", "mode": "paged_jax", "output_tokens_per_s": 250.0}]
    summary = summarize(runs, ["both_cores", "default"])
    assert summary["paged_jax_mean_output_tokens_per_s"] == 200.0
    assert summary["both_cores"] == {"vllm_mean_output_tokens_per_s": 200.0, "ratio": 1.0,
                                     "ratio_per_round": [1.5, 0.83]}
    assert summary["default"]["ratio"] == 4.0 and summary["default"]["ratio_per_round"] == [3.0, 5.0]


def test_wrong_lengths():
    assert wrong_lengths([[1, 2], [3], [4, 5, 6]], [2, 2, 3]) == [1]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # a strict prefix differs where it ends


def test_tie_queries_one_per_prefix_with_both_tokens():
    candidates = [[[1, 2, 3], [4, 9, 9], [7, 8, 9]],  # request 1 differs at token 1
                  [[1, 2, 3], [4, 7, 0], [7, 8]]]  # the same prefix, another token; a cut-short one
    assert tie_queries(PROMPTS, REFERENCE, candidates) == [{"ids": [7, 4], "tokens": [5, 7, 9]}]


def _logits(gaps: dict):
    """reference_logits: at prefix ids, the reference token 0.0 and the other -gap."""
    queries, values = [], []
    for ids, (want, got, gap) in gaps.items():
        queries.append({"ids": list(ids), "tokens": [want, got]})
        values.append([0.0, -gap])
    return sparse_logits(queries, values, vocab_size=16)


def test_compare_accepts_only_checked_near_ties_and_compares_every_request():
    candidate = [[1, 9, 9],  # request 0: differs at 1, a near tie
                 [4, 6, 6],  # request 1: differs at 1, not a near tie
                 [7, 8, 0]]  # request 2: differs at 2, a tie never looked up (NaN): not accepted
    logits = _logits({(5, 6, 1): (2, 9, 5e-4), (7, 4): (5, 6, 0.5)})
    counts = compare_outputs(PROMPTS, REFERENCE, candidate, logits)
    assert (counts["equal"], counts["near_tie"], counts["mismatch"], counts["unchecked"]) == (0, 1, 2, 0)
    assert counts["mismatched_requests"] == [1, 2]
    assert counts["first_differences"] == {"0": 1, "1": 1, "2": 2}
    assert compare_outputs(PROMPTS, REFERENCE, REFERENCE, logits)["equal"] == 3


def test_compare_without_logits_counts_differences_unchecked():
    counts = compare_outputs(PROMPTS, REFERENCE, [[1, 2, 3], [4, 5, 0], [7, 8, 9]])
    assert (counts["equal"], counts["near_tie"], counts["mismatch"], counts["unchecked"]) == (2, 0, 0, 1)
    with pytest.raises(ValueError):
        compare_outputs(PROMPTS, REFERENCE, REFERENCE[:2])


def test_sparse_logits_unknown_prefix_is_nan():
    logits = sparse_logits([{"ids": [1], "tokens": [3]}], [[2.5]], vocab_size=8)
    assert logits([1])[3] == 2.5 and np.isnan(logits([1])[4]) and np.isnan(logits([2])[3])


def _record(runs_check):
    return {"name": "peer_vllm", "flags": {"num_requests": 64, "workload": "sharegpt", "scale": 1.0,
                                           "max_num_seqs": 64, "rounds": 2, "vllm_modes": ["both_cores", "default"]},
            "environment": {"platform": "cpu", "cpu_count": 2},
            "figures": {"model": "x/SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32", "mean_prompt_tokens": 160.3,
                        "mean_output_tokens": 343.1, "versions": {"vllm": "0.32.0"},
                        "summary": {"paged_jax_mean_output_tokens_per_s": 120.0,
                                    "both_cores": {"vllm_mean_output_tokens_per_s": 100.0, "ratio": 1.2},
                                    "default": {"vllm_mean_output_tokens_per_s": 80.0, "ratio": 1.5}},
                        "greedy_check": {"reference": "vllm both_cores round 1", "runs": runs_check}}}


def test_row_reads_figures_and_reports_mismatches():
    equal = {"equal": 64, "near_tie": 0, "mismatch": 0, "unchecked": 0}
    [(figure, value)] = results_rows.peer_vllm(_record({"paged_jax round 1": equal, "paged_jax round 2": equal}))
    assert "vLLM 0.32.0" in figure and "ShareGPT-like" in figure and "float32" in figure
    assert shows_in_order(figure, "64")
    # vLLM both cores / default, paged_jax tok/s, then paged_jax / vLLM per mode
    assert numbers(value)[:5] == ["100.0", "80.0", "120.0", "1.20", "1.50"]
    record = _record({"paged_jax round 1": equal})
    record["figures"]["summary"]["both_cores"]["ratio_per_round"] = [1.31, 1.09]
    [(_, per_round)] = results_rows.peer_vllm(record)
    assert numbers(per_round)[:7] == ["100.0", "80.0", "120.0", "1.20", "1.50", "1.31", "1.09"]
    off = {"equal": 61, "near_tie": 2, "mismatch": 1, "unchecked": 0}
    [(_, mismatched)] = results_rows.peer_vllm(_record({"vllm default round 1": equal, "paged_jax round 1": off}))
    assert shows_in_order(mismatched, "61", "2", "1") and mismatched != value  # the counts, where not all equal
    assert results_rows.BUILDERS["peer_vllm"] is results_rows.peer_vllm
