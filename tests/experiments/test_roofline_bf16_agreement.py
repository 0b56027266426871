"""experiments/roofline.py and experiments/bf16_agreement.py: their counting and comparison
functions, results-table rows and the roofline plot, on made-up figures (no model runs).

The scripts define absl flags that clash with experiments/peer_hf.py's in one test
process, so their pure functions run in a subprocess; the rows and the plot are in
modules without flags.
"""

import json
import os
import subprocess
import sys

from tests.helpers.row_numbers import numbers, shows_in_order

from experiments import plots

from experiments.reporting import results_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ROOFLINE = r"""
import json
import configs
from experiments import roofline as r
cfg = configs.get_config("smollm2_135m")
per_token = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
print(json.dumps({
    "decode": r.matmul_flops(cfg, 8, 8) == 2 * 8 * (30 * per_token + 576 * 49152),
    "prefill_head_once": r.matmul_flops(cfg, 256, 1) == 2 * (256 * 30 * per_token + 576 * 49152),
    # 3 query tokens at positions 0..2 see 1 + 2 + 3 keys; one decode token at position 9 sees 10
    "attention": r.attention_flops(cfg, [3, 1], [0, 9]) == 4 * 30 * 9 * 64 * 16,
    "kv": r.kv_read_bytes(cfg, [10, 6], 2) == 2 * 30 * 3 * 64 * 2 * 16,
    # 100 GFLOP at 200 GFLOP/s = 500 ms, then attention: 2 GFLOP at 200 = 10 ms vs 1 GB at 20 GB/s = 50 ms
    "serial_memory": abs(r.serial_bound_ms(100e9, 2e9, 1e9, 200.0, 20.0) - 550.0) < 1e-9,
    # 40 GFLOP of attention = 200 ms beats 1 GB at 20 GB/s
    "serial_compute": abs(r.serial_bound_ms(100e9, 40e9, 1e9, 200.0, 20.0) - 700.0) < 1e-9,
}))
"""
_AGREEMENT = r"""
import json
from experiments import bf16_agreement as b
print(json.dumps({
    "agreement": b.output_agreement([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 3, 4], [5, 6, 0, 0], [0, 9]]),
    "closeness": b.logit_closeness([[0.0, 1.0, 0.9], [2.0, 0.0, 0.0]], [[0.0, 0.9, 1.0], [2.0, 0.5, 0.0]]),
}))
"""


def _run(code: str) -> dict:
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_roofline_counts():
    assert _run(_ROOFLINE) == {"decode": True, "prefill_head_once": True, "attention": True, "kv": True,
                               "serial_memory": True, "serial_compute": True}


def test_output_agreement_and_logit_closeness():
    out = _run(_AGREEMENT)
    a = out["agreement"]
    assert a["identical"] == 1 and a["first_differences"] == [None, 2, 0]
    assert a["mean_fraction_before_first_difference"] == round((1 + 0.5 + 0) / 3, 4)
    assert a["first_difference"]["median"] == 1
    c = out["closeness"]
    assert c["top1_agreement"] == 0.5 and c["max_abs_diff"] == 0.5
    assert c["f32_gaps_on_disagreement"] == [0.1]  # f32 prefers token 1 over bf16's token 2 by 1.0 - 0.9


def _roofline_record():
    def step(dtype, kind, seqs, tokens, ms, ai, gflops, ceiling):
        return {"dtype": dtype, "kind": kind, "seqs": seqs, "tokens": tokens, "context_len": 256, "step_ms": ms,
                "achieved_gflops": gflops, "ceiling_gflops": ceiling, "fraction_of_ceiling": gflops / ceiling,
                "achieved_gbs": 15.0, "fraction_of_bandwidth": 15.0 / 21.0, "arithmetic_intensity": ai,
                "step_over_roofline": 1.5, "bound": "memory" if kind == "decode" else "compute",
                "weight_layout": "amx_tiles" if dtype == "bfloat16" else "in_out", "kv_cache_dtype": dtype,
                "serial_bound_ms": ms / 1.25, "step_over_serial_bound": 1.25, "max_fraction_of_ceiling": 0.6}
    steps = [step("float32", "decode", 8, 8, 30.0, 3.5, 60.0, 150.0),
             step("float32", "prefill", 1, 1024, 900.0, 400.0, 240.0, 250.0),
             step("bfloat16", "decode", 8, 8, 20.0, 7.0, 90.0, 300.0),
             step("bfloat16", "prefill", 1, 1024, 500.0, 800.0, 430.0, 1000.0)]
    ceilings = [{"dtype": d, "rows": r, "gflops": g} for d, r, g in
                (("float32", 8, 150.0), ("float32", 1024, 250.0), ("bfloat16", 8, 300.0), ("bfloat16", 1024, 1000.0))]
    return {"name": "roofline", "command": "python -m experiments.roofline", "flags": {"context_len": 256},
            "environment": {"platform": "cpu", "cpu_count": 2},
            "figures": {"model": "random:tiny_llama", "bandwidth_gbs": 21.0, "steps": steps, "ceilings": ceilings}}


def test_roofline_rows_and_plot(tmp_path):
    record = _roofline_record()
    rows = results_rows.BUILDERS["roofline"](record)
    assert [f.split(", ")[2].split(" ")[0] for f, _ in rows] == ["float32", "bfloat16"]
    # bf16 decode 8: 20 ms, 90 GFLOP/s = 30.0% of the 300 ceiling, 15.0 GB/s = 71.4% of 21,
    # 1.5x the memory bound, 1.25x the serial bound, which allows 60.0%
    assert numbers(rows[1][1])[:10] == ["8", "20.0", "90", "30.0", "300", "15.0", "71.4", "1.5", "1.25", "60.0"]
    assert shows_in_order(rows[1][1], "1024", "500.0", "430", "43.0", "1000")  # prefill: 430 / 1000 = 43.0%
    path = plots.roofline(record, str(tmp_path))
    assert path == str(tmp_path / "roofline.png") and os.path.getsize(path) > 5_000
    assert plots.PLOTS["roofline"][0] == "roofline.json"


def test_bf16_agreement_row():
    record = {"name": "bf16_agreement", "flags": {"max_output_tokens": 120}, "environment": {"platform": "cpu"},
              "figures": {"model": "random:tiny_llama", "workload": "sharegpt",
                          "outputs": {"num_requests": 64, "identical": 40,
                                      "mean_fraction_before_first_difference": 0.8125,
                                      "first_difference": {"median": 37.5, "p25": 12, "p75": 80}},
                          "logits": {"num_prompts": 16, "max_abs_diff": 0.21, "mean_abs_diff": 0.031,
                                     "mean_abs_f32_logit": 4.2, "top1_agreement": 0.9375,
                                     "f32_gaps_on_disagreement": [0.0123]},
                          "divergences": {"median_float32_gap": 0.05}}}
    [(figure, value)] = results_rows.BUILDERS["bf16_agreement"](record)
    assert shows_in_order(figure, "64", "120", "16")  # requests, output cap, prompts whose logits are compared
    # 40 of 64 equal, 81.2% before the first difference, its median and quartiles
    assert numbers(value)[:6] == ["40", "64", "81.2", "37.5", "12", "80"]
    assert shows_in_order(value, "93.8", "0.0123", "0.05") and numbers(value)[-1] == "0.05"
