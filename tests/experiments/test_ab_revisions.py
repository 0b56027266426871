"""experiments/ab_revisions.py: two revisions in their own checkouts, A B A B, on a tiny model."""

import json
import subprocess
import sys

from experiments.reporting import results_rows
from tests.helpers.row_numbers import shows_in_order

TINY = ["--model=tiny_llama", "--num_requests=3", "--max_output_tokens=6", "--max_model_len=128", "--max_num_seqs=4",
        "--max_num_batched_tokens=64", "--kv_cache_gib=0.01", "--rounds=1"]


def test_the_same_revision_twice_gives_equal_outputs_and_a_row(tmp_path):
    """HEAD against HEAD with async scheduling on one side: equal outputs, both sides measured."""
    done = subprocess.run([sys.executable, "-m", "experiments.ab_revisions", "--a=HEAD", "--b=HEAD",
                           "--b_engine=async_scheduling=true", *TINY, f"--output={tmp_path / 'ab_dry_run.json'}"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    [path] = tmp_path.glob("ab_dry_run.json")
    record = json.loads(path.read_text())
    fig = record["figures"]
    assert [(r["side"], r["round"]) for r in fig["runs"]] == [("a", 1), ("b", 1)]
    assert fig["outputs_equal"] and fig["revisions"]["a"]["commit"] == fig["revisions"]["b"]["commit"]
    assert fig["revisions"]["b"]["engine"] == {"async_scheduling": True}
    [(label, value)] = results_rows.BUILDERS["ab_revisions"](record)
    best = fig["best_output_tokens_per_s"]
    assert shows_in_order(value, f"{best['a']:.1f}", f"{best['b']:.1f}", f"{fig['b_over_a']:.3f}")
    assert "async_scheduling=True" in label
