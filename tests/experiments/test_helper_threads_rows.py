"""experiments/helper_threads.py's summary of its rounds and its results-table row, on made-up
figures (no model runs). The script's absl flags clash with other experiments' in one
test process, so its pure function runs in a subprocess."""

import json
import os
import subprocess
import sys

from tests.helpers.row_numbers import numbers, shows_in_order

from experiments.reporting import results_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SUMMARY = r"""
import json
from experiments import helper_threads as h
rounds = [{0: 100.0, 300: 80.0}, {0: 130.0, 300: 100.0}, {0: 90.0, 300: 90.0}]
print(json.dumps(h.summarize("decode", 64, 64, [0, 300], rounds)))
"""


def test_summary_takes_medians_of_times_and_of_the_rounds_ratios():
    run = subprocess.run([sys.executable, "-c", _SUMMARY], cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["windows"]["0"] == {"step_ms": 100.0, "step_ms_rounds": [100.0, 130.0, 90.0]}
    # ratios 1.25, 1.3, 1.0: their median, not median(0) / median(300) = 100 / 90
    assert out["windows"]["300"] == {"step_ms": 90.0, "step_ms_rounds": [80.0, 100.0, 90.0], "speedup": 1.25}
    assert (out["kind"], out["seqs"], out["tokens"]) == ("decode", 64, 64)


def test_row():
    steps = [{"dtype": "float32", "kind": "decode", "seqs": 64, "tokens": 64,
              "windows": {"0": {"step_ms": 120.0}, "300": {"step_ms": 100.0, "speedup": 1.2}}},
             {"dtype": "bfloat16", "kind": "prefill", "seqs": 1, "tokens": 256,
              "windows": {"0": {"step_ms": 50.0}, "300": {"step_ms": 51.0, "speedup": 0.98}}}]
    record = {"name": "helper_threads", "flags": {"spin_us": ["0", "300"], "context_len": 256, "rounds": 6},
              "environment": {"platform": "cpu", "cpu_count": 2},
              "figures": {"model": "random:tiny_llama", "steps": steps}}
    [(figure, value)] = results_rows.BUILDERS["helper_threads"](record)
    assert {"256", "6", "300"} <= set(numbers(figure))  # context, rounds, the spin window compared
    # per step, in the record's order: ms with XLA's pool, ms with the window, the speedup
    assert shows_in_order(value, "64", "120.0", "100.0", "1.20", "256", "50.0", "51.0", "0.98")
    assert value.index("float32") < value.index("bfloat16")
