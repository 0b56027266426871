"""Prefill / decode through vllm-router's prefill / decode mode (experiments/fleet_pd.py):
a prefill and a decode serve_local replica give, over streaming HTTP, the same greedy
tokens as one mixed replica, and every request's answer has all its tokens. Needs the
router's venv (experiments/setup_router.sh, run here when missing: PyPI only) and three
SmolLM2 replicas started in turn: slow.
"""

import os
import subprocess

import pytest

from experiments.disagg_prefill_decode import make_trace
from experiments.fleet_pd import run_mode
from experiments.serve_fleet import default_router_binary

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLICA_FLAGS = ("--max_num_seqs=4 --max_num_batched_tokens=64 --max_model_len=256 --seq_buckets=4 "
                 "--token_buckets=16,64 --layer_loop=scan")


@pytest.mark.slow
def test_prefill_decode_through_the_router_equals_one_mixed_replica(tmp_path):
    if not os.path.exists(default_router_binary()):
        subprocess.run(["bash", os.path.join(REPO, "experiments", "setup_router.sh")], check=True)
    # one long prompt (several 64-token chunks, so several K/V blocks to move) among short ones
    trace = make_trace(5, 0.3, 150, 12, 6, rate=4.0, vocab_size=49152, seed=3)
    assert any(item["long"] for item in trace)
    runs = {mode: run_mode(mode, trace, REPLICA_FLAGS, 18750, log_dir=str(tmp_path / mode)) for mode in ("mixed", "pd")}
    for mode, run in runs.items():
        assert run["num_ok"] == len(trace), (mode, run["errors"])
        assert all(len(tokens) == 6 for tokens in run["tokens"].values()), mode
    assert runs["pd"]["tokens"] == runs["mixed"]["tokens"]
