"""The end of experiments/gpu_bench.sh's output: each record of the run as its results-table rows.

    python -m experiments.gpu_bench_summary experiments/results gpu_bench_h100_smollm2_135m ...

Why the table's own rows (experiments/reporting/results_rows.py BUILDERS): the device tool
returns only the end of a command's output, so the figures that matter are printed last, in the
words docs/results.md will use for them; a record that is missing (its stage failed or was cut
before its first part) is said to be missing.
"""

from __future__ import annotations

import json
import os
import sys


def summary_lines(results_dir: str, names: list[str]) -> list[str]:
    from experiments.reporting.result_commands import reproducing_command
    from experiments.reporting.results_rows import BUILDERS
    lines = []
    for name in names:
        path = os.path.join(results_dir, f"{name}.json")
        if not os.path.exists(path):
            lines.append(f"{name}: no record")
            continue
        with open(path) as f:
            record = json.load(f)
        module = reproducing_command(record).module
        try:
            rows = BUILDERS[module](record)
        except (KeyError, TypeError, ValueError) as e:  # a record cut short can lack what a builder reads
            rows = [("unreadable", f"{type(e).__name__}: {e}")]
        lines += [f"{name}: {figure}: {value}" for figure, value in rows]
    return lines


if __name__ == "__main__":
    print("\n".join(summary_lines(sys.argv[1], sys.argv[2:])))
