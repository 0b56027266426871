"""Block maps (experiments/reporting/block_map.py) and the block-map movie's replay.

A block's cell has its owner's colour (pale where a contiguous reservation is not yet
written), the shared / cached / fragment / free / null colours otherwise; the movie's
replay through the simulator shows a contiguous-max pool reserving whole max_model_len
runs while the paged pool on the same trace holds only what its tokens need; and the
script writes a GIF and a PNG.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import configs
from experiments.benchmarks.workloads import make_trace
from experiments.block_map_movie import at, record_snapshots
from experiments.reporting.block_map import (CACHED, FRAGMENT, FREE, NULL, RESERVED_TINT, SHARED, block_map_image,
                                             owner_color)
from experiments.simulator.step_time_model import StepTimeModel
from paged_jax.config.engine_config import EngineConfig
from paged_jax.core.block_pool import BLOCK_STATES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_MODEL = os.path.join(ROOT, "experiments", "results", "step_time_model.json")


def _seq(blocks, reservation=None, on_host=False):
    seq = {"seq_id": 0, "index": 0, "num_tokens": 1, "num_computed_tokens": 0, "blocks": blocks, "on_host": on_host}
    if reservation is not None:
        seq["reservation"] = reservation
    return seq


def test_each_cell_has_its_owners_or_its_states_colour():
    # blocks: 0 null, 1-2 a's (used), 3 shared, 4 cached, 5 free, 6-7 b written / reserved, 8 fragment
    snap = {"states": list(BLOCK_STATES), "blocks": "411230156",
            "requests": [{"request_id": "a", "state": "running", "seqs": [_seq([1, 2, 3]), _seq([3])]},
                         {"request_id": "b", "state": "running", "seqs": [_seq([6], reservation=[6, 2])]}]}
    image = block_map_image(snap, columns=3)
    assert image.shape == (3, 3, 3)
    cells = image.reshape(-1, 3)
    a, b = np.array(owner_color("a")), np.array(owner_color("b"))
    assert not np.allclose(a, b)
    np.testing.assert_allclose(cells, [NULL, a, a, SHARED, CACHED, FREE, b, b + (1 - b) * RESERVED_TINT, FRAGMENT])


@pytest.fixture(scope="module")
def replays():
    model_config = configs.get_config("smollm2_135m")
    trace = make_trace("sharegpt", 24, seed=0, max_model_len=1024, vocab_size=model_config.vocab_size,
                       request_rate=4.0)
    out = {}
    for allocator in ("paged", "contiguous-max"):
        config = EngineConfig(block_size=16, num_blocks=193, max_model_len=1024, max_num_seqs=16,
                              max_num_batched_tokens=256, kv_allocator=allocator, enable_prefix_caching=False,
                              attention_backend="reference")
        out[allocator] = record_snapshots(trace, config, StepTimeModel.load(STEP_MODEL), model_config)
    return out


def test_contiguous_max_reserves_whole_runs_and_paged_only_what_tokens_need(replays):
    paged, contiguous = replays["paged"], replays["contiguous-max"]
    for snaps in (paged, contiguous):
        assert snaps[-1]["requests"] == [] and set(snaps[-1]["blocks"][1:]) <= {"0", "3"}  # all served
        times = [s["time"] for s in snaps]
        assert times == sorted(times) and at(snaps, times, times[-1] + 1) is snaps[-1]
    assert not any("5" in s["blocks"] for s in paged)  # paged never reserves
    held = [s for s in contiguous if s["requests"]]
    assert held and all(len(q["reservation"]) == 2 and q["reservation"][1] == 1024 // 16
                        for s in held for r in s["requests"] for q in r["seqs"] if q["blocks"])
    assert max(s["blocks"].count("5") for s in contiguous) > 0.5 * 192  # mostly reserved, not written
    # the same moment: contiguous-max has fewer requests running than paged
    mid = paged[len(paged) // 3]["time"]
    run = lambda snaps: at(snaps, [s["time"] for s in snaps], mid)["counters"]["num_running"]  # noqa: E731
    assert run(contiguous) < run(paged)


def test_the_script_writes_a_gif_and_a_png(tmp_path):
    out = str(tmp_path / "movie")
    proc = subprocess.run([sys.executable, "-m", "experiments.block_map_movie", "--num_requests=12", "--frames=6",
                           "--num_blocks=129", "--max_model_len=1024", f"--output={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from PIL import Image
    with Image.open(out + ".gif") as gif:
        assert gif.n_frames == 6
    with Image.open(out + ".png") as png:
        assert png.size[0] > png.size[1] > 100
