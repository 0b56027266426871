"""experiments/plots.py: every plot makes a real PNG, from the committed records and from
small synthetic records of the schemas still being written; missing inputs are skipped."""

import copy
import json
import os
import shutil

import numpy as np
import pytest
from tests.helpers.synthetic_records import (
    block_sweep_record,
    serving_sweep_record,
    throughput_record,
)

from experiments import plots

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments", "results")


def _assert_png(path, min_colors=3):
    """A non-empty PNG with a drawing in it (more than a blank canvas and its text)."""
    import matplotlib.image
    assert os.path.getsize(path) > 5_000, path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[0] >= 300 and image.shape[1] >= 500
    colors = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) >= min_colors
    # colored (not only gray) pixels: the bars / lines in the tab palette
    rgb = image[..., :3]
    assert ((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.3).mean() > 0.002


@pytest.mark.parametrize("name", ["utilization_waste", "sharing_savings", "real_fleet_routing"])
def test_plots_from_committed_records(name, tmp_path):
    filename, plot = plots.PLOTS[name]
    with open(os.path.join(RESULTS_DIR, filename)) as f:
        record = json.load(f)
    path = plot(record, str(tmp_path))
    assert path == os.path.join(str(tmp_path), f"{name}.png")
    _assert_png(path)
    assert os.path.getsize(path) < 150_000


@pytest.mark.parametrize("name, make", [("utilization_waste", throughput_record), ("batched_timeline", throughput_record),
                                        ("latency_vs_rate", serving_sweep_record),
                                        ("block_size_sweep", block_sweep_record)])
def test_plots_from_synthetic_records(name, make, tmp_path):
    _, plot = plots.PLOTS[name]
    _assert_png(plot(make(), str(tmp_path)))


def test_tokens_held_recorded_or_estimated():
    row = {"kv_utilization": 0.8, "waste_internal_slots": 30.0, "waste_reservation_slots": 20.0}
    # held / (held + 50) = 0.8  ->  held = 0.8 / 0.2 * 50 = 200
    assert plots.tokens_held_slots(row) == pytest.approx((200.0, True))
    assert plots.tokens_held_slots({**row, "tokens_held_slots": 123}) == (123.0, False)


def test_timeline_steps():
    row = {"batched_seqs_timeline": [1, 2, 3, 4, 5], "timeline_stride": 4, "num_steps": 100}
    assert plots.timeline_steps(row) == [0, 4, 8, 12, 16]
    # only the last 5 * 4 = 20 of 100 steps were logged: samples at 80, 84, ..., 96
    assert plots.timeline_steps({**row, "timeline_complete": False}) == [80, 84, 88, 92, 96]


def test_make_plots_skips_missing_inputs_and_old_schemas(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    old = throughput_record()
    for row in old["figures"]["allocators"]:  # a record written before the timeline existed
        del row["batched_seqs_timeline"]
    (results / "benchmark_throughput.json").write_text(json.dumps(old))
    shutil.copy(os.path.join(RESULTS_DIR, "sharing_savings.json"), results / "sharing_savings.json")
    made = plots.make_plots(str(results), str(tmp_path / "out"))
    printed = capsys.readouterr().out
    assert made["latency_vs_rate"] is None and "skip latency_vs_rate" in printed and "serving_sweep_kv2.json" in printed
    assert made["block_size_sweep"] is None and "skip block_size_sweep" in printed
    assert made["batched_timeline"] is None and "skip batched_timeline" in printed
    assert sorted(os.listdir(tmp_path / "out")) == ["sharing_savings.png", "utilization_waste.png"]
    assert made["sharing_savings"] == str(tmp_path / "out" / "sharing_savings.png")
    made = plots.make_plots(str(results), str(tmp_path / "only"), only=["sharing_savings"])
    assert list(made) == ["sharing_savings"] and os.listdir(tmp_path / "only") == ["sharing_savings.png"]
    with pytest.raises(ValueError, match="unknown plot names"):
        plots.make_plots(str(results), str(tmp_path), only=["no_such_plot"])


def test_titles_name_the_records_model(tmp_path, monkeypatch):
    titles = []
    real_save = plots._save

    def save(fig, out_dir, name):
        titles.append(fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title())
        return real_save(fig, out_dir, name)
    monkeypatch.setattr(plots, "_save", save)
    record = copy.deepcopy(serving_sweep_record())
    record["figures"]["model"] = "/some/where/Other-1B.Q8_0.gguf"
    plots.latency_vs_rate(record, str(tmp_path))
    plots.utilization_waste(throughput_record(), str(tmp_path))
    assert "Other-1B" in titles[0] and "ShareGPT-like" in titles[0]
    assert "random-weight tiny_llama" in titles[1] and "12 ShareGPT-like" in titles[1]
