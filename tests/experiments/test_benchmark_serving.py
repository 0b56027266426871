"""experiments/benchmark_serving.py --compare_offline: the same trace offline and through the
server on one engine, A B A B, and the row that reports the server's share."""

import json
import subprocess
import sys

import pytest

from experiments.reporting import results_rows
from tests.helpers.row_numbers import shows_in_order


def test_row_reports_the_servers_share_of_offline():
    record = {"flags": {"request_rate": "inf", "workload": "sharegpt", "scale": 0.1, "model": "smollm2-135m"},
              "figures": {"num_requests": 64, "mean_prompt_tokens": 20.0, "mean_output_tokens": 30.0,
                          "output_token_throughput": 270.0, "request_throughput": 9.0,
                          "tpot": {"p50_ms": 50.0}, "ttft": {"p50_ms": 2000.0},
                          "offline_output_token_throughput": 300.0, "server_vs_offline": 0.9}}
    [(_, value)] = results_rows.benchmark_serving(record)
    assert shows_in_order(value, "270", "300", "90")


@pytest.mark.slow  # SmolLM2 loads and compiles (~1 min on 2 cores)
def test_compare_offline_runs_both_sides(tmp_path):
    out = tmp_path / "serving.json"
    subprocess.run([sys.executable, "-m", "experiments.benchmark_serving", "--num_requests=4", "--scale=0.03",
                    "--compare_offline", "--rounds=2", "--max_num_seqs=4", "--max_num_batched_tokens=64",
                    "--max_model_len=256", "--seq_buckets=4", "--token_buckets=8,64", f"--output={out}"],
                   check=True, timeout=900)
    fig = json.loads(out.read_text())["figures"]
    assert fig["num_completed"] == 4
    assert len(fig["offline_output_token_throughput_per_round"]) == 2 == len(fig["server_output_token_throughput_per_round"])
    assert fig["offline_output_token_throughput"] > 0 and fig["server_vs_offline"] > 0
