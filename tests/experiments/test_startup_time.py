"""experiments/startup_time.py's dry run: a tiny random-weight model with two small
buckets, started cold and then warm in fresh processes, as the record's runs are.

It checks what the record relies on: every phase hook still finds its function (a moved
one would record None), the cold run fills the persistent compilation cache and the
executable cache and the warm run reads every warm-up program whole from the latter (it
traces nothing), warm-up's buckets are the engine's, the phases add
up to the time to ready, and both runs generate the same greedy tokens."""

import json
import os
import subprocess
import sys

from paged_jax.config.engine_config import default_buckets
from paged_jax.worker.batch_inputs import all_batch_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 4


def test_dry_run_cold_then_warm():
    command = [sys.executable, "-m", "experiments.startup_time", "--model=tiny_llama", "--max_num_seqs=2",
               "--max_num_batched_tokens=16", "--max_model_len=64", f"--max_tokens={MAX_TOKENS}",
               "--nocold_kernel_cache", "--output="]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout[run.stdout.index("\n{") + 1:])
    cold, warm = figures["runs"]
    assert (cold["run"], warm["run"]) == ("cold", "warm")
    assert figures["greedy_outputs_equal"] and 1 <= len(cold["output_token_ids"]) <= MAX_TOKENS

    shapes = all_batch_shapes(default_buckets(1, 2), default_buckets(8, 16))  # what warm-up must compile
    for r in (cold, warm):
        assert r["hooks_missing"] == []
        p = r["phases_s"]
        assert all(isinstance(v, float) and v >= 0 for v in p.values()), p
        assert [(b["num_seqs"], b["num_tokens"]) for b in r["warm_up_buckets"]] == shapes
        # the phases before ready cover it (up to the few statements between them)
        before_ready = p["python_start"] + p["import_jax"] + p["import_paged_jax"] + p["llm_init"]
        assert before_ready <= r["ready_s"] <= before_ready + 1.0
        assert p["warm_up"] + p["runner_build"] + p["model_load"] <= p["llm_init"] + 1e-3
        assert sum(b["seconds"] for b in r["warm_up_buckets"]) <= p["warm_up"] + 1e-3
        assert p["weight_packing"] <= p["runner_build"] + 1e-3

    # the cold run compiles every program and stores it in both caches ...
    assert cold["compile"]["warm_up"]["cache_misses"] > 0 and cold["compile"]["warm_up"]["cache_hits"] == 0
    assert figures["cache_entries_after"] >= cold["compile"]["warm_up"]["programs"]
    stored = cold["executable_cache"]["misses"]
    assert stored > 0 and cold["executable_cache"]["hits"] == 0 and cold["phases_s"]["executable_cache_write"] > 0
    assert figures["executable_cache_entries_after"] == stored
    # ... and the warm run reads every one whole from the executable cache: warm-up traces nothing
    assert warm["executable_cache"] == {**warm["executable_cache"], "hits": stored, "misses": 0, "unreadable": 0}
    assert warm["executable_cache"]["read_s"] > 0 and warm["phases_s"]["executable_cache_read"] > 0
    assert warm["compile"]["warm_up"]["trace_s"] == 0 and warm["compile"]["warm_up"]["cache_misses"] == 0


def test_results_row_shows_cold_and_best_warm_time():
    from experiments.reporting import results_rows
    record = {"figures": {"model": "smollm2-135m", "runs": [{"run": "cold", "ready_s": 38.17},
                                                            {"run": "warm1", "ready_s": 13.44},
                                                            {"run": "warm2", "ready_s": 12.96}]},
              "environment": {"platform": "cpu", "cpu_count": 2}}
    [(figure, value)] = results_rows.BUILDERS["startup_time"](record)
    assert "smollm2-135m" in figure and "cold / warm" in figure
    assert value == "38.2 s / 13.0 s"
