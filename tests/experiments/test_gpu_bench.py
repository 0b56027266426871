"""experiments/gpu_bench.sh and its drivers: the CPU dry run end to end (the script a lent GPU runs
unattended must not first fail there), the device-busy arithmetic on profiler planes, the decode
roofline, and the presets and transformers configs the benchmark serves."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import configs
from experiments.gpu_bench import decode_roofline
from experiments.gpu_bench_profile import device_busy, union_ns
from experiments.reporting.results_io import RESULTS_DIR
from experiments.reporting.results_rows import BUILDERS
from paged_jax.config.model_config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plane(name, lines):
    """A profiler plane as jax.profiler.ProfileData shows one: lines of events (start_ns, end_ns)."""
    return SimpleNamespace(name=name, lines=[
        SimpleNamespace(name=line, events=[SimpleNamespace(start_ns=s, end_ns=e) for s, e in events])
        for line, events in lines.items()])


def test_union_counts_overlapping_time_once():
    assert union_ns([]) == 0
    assert union_ns([(0, 10), (20, 30)]) == 20
    assert union_ns([(0, 10), (5, 15), (2, 3)]) == 15  # overlapping, and one inside another
    assert union_ns([(10, 20), (0, 10)]) == 20  # touching, given out of order


def test_device_busy_is_the_union_of_its_stream_events():
    """Streams A [0,10] [20,30] and B [5,15] [40,50]: busy [0,15] [20,30] [40,50] = 35 ns of a 50 ns
    span; the "XLA Modules" line (one event over everything) and the host plane are not counted."""
    gpu = _plane("/device:GPU:0", {"Stream #7(Compute)": [(0, 10), (20, 30)], "Stream #9(Copy)": [(5, 15), (40, 50)],
                                   "XLA Modules": [(0, 100)]})
    host = _plane("/host:CPU", {"python": [(0, 1000)]})
    busy = device_busy([host, gpu])
    assert busy["available"] and busy["busy_ms"] == 35e-6 and busy["span_ms"] == 50e-6
    assert busy["lines_used"] == "streams" and busy["num_events"] == 4
    # a device plane without stream lines (a TPU's) falls back to its XLA Ops line
    tpu = device_busy([_plane("/device:TPU:0", {"XLA Modules": [(0, 100)], "XLA Ops": [(0, 30), (60, 70)]})])
    assert tpu["busy_ms"] == 40e-6 and tpu["lines_used"] == "XLA Ops"


def test_a_trace_without_a_device_plane_is_unavailable_and_names_its_planes():
    busy = device_busy([_plane("/host:CPU", {"python": [(0, 10)]}), _plane("Task Environment", {})])
    assert not busy["available"] and "/host:CPU, Task Environment" in busy["reason"]
    empty = device_busy([_plane("/device:GPU:0", {"Stream #1": []})])
    assert not empty["available"] and "no events" in empty["reason"]


def test_the_decode_roofline_takes_the_larger_of_its_bytes_and_its_flops():
    """2 layers, 1 KV head of 4, 2-byte K/V, 3 sequences at context 10: K/V 2*2*1*4*2*3*10 = 960 bytes;
    with 1040 bytes of weights 2000 bytes at 1 GB/s = 0.002 ms, so 3 tokens per 0.002 ms = 1.5M tok/s.
    Matmuls per token: 2 layers * (8*(8+2*4) + 8*8 + 3*8*16) = 2 * 576 = 1152, head 8*32 = 256, so
    3 tokens * 1408 * 2 = 8448 FLOP; at 1e-3 TFLOP/s that is 0.008448 ms, which then bounds the step."""
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4)
    memory = decode_roofline(cfg, 3, 10, 1040, 2, bandwidth_gbs=1.0, matmul_tflops=None)
    assert memory["kv_bytes"] == 960 and memory["memory_ms"] == 0.002 and memory["bound"] == "memory"
    assert memory["roofline_output_tokens_per_s"] == 1.5e6 and memory["compute_ms"] is None
    compute = decode_roofline(cfg, 3, 10, 1040, 2, bandwidth_gbs=1.0, matmul_tflops=1e-3)
    assert compute["matmul_gflop"] == round(8448 / 1e9, 3) and compute["compute_ms"] == 0.0084
    assert compute["bound"] == "compute" and compute["roofline_ms"] == 0.0084


def test_the_presets_have_the_published_models_parameter_counts():
    """Llama-3.1-8B: 8,030,261,248 parameters (its model card's 8B, to the parameter);
    Qwen3-0.6B: 0.6B, 0.44B without the embedding (its model card)."""
    assert configs.get_config("llama3_1_8b").num_params() == 8_030_261_248
    qwen = configs.get_config("qwen3_0_6b")
    assert round(qwen.num_params() / 1e8) == 6
    assert round((qwen.num_params() - qwen.vocab_size * qwen.hidden_size) / 1e7) == 44


@pytest.mark.parametrize("preset", ["smollm2_135m", "qwen3_0_6b", "llama3_1_8b", "tiny_qwen3"])
def test_the_transformers_peer_has_the_presets_shapes(preset):
    """The peer's model, built on the meta device (no memory), holds as many parameters as the
    preset: same layers, heads, widths, vocabulary and tying."""
    torch = pytest.importorskip("torch")
    import transformers

    from experiments.gpu_bench_peer import hf_config
    cfg = configs.get_config(preset)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg))
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model.config.tie_word_embeddings == cfg.tie_word_embeddings


def test_an_hf_peer_that_failed_has_a_row_saying_so():
    record = {"environment": {"platform": "gpu", "device": "NVIDIA H100 80GB HBM3"}, "figures": {
        "engine": "hf_continuous", "preset": "smollm2_135m", "dtype": "bfloat16", "workload": "sharegpt",
        "num_requests": 512, "mean_prompt_tokens": 160.0, "mean_output_tokens": 330.0,
        "hf_continuous": {"error": "RuntimeError: no paged attention"}}}
    [(figure, value)] = BUILDERS["gpu_bench"](record)
    assert "transformers continuous batching" in figure and value.startswith("failed: RuntimeError")
    assert "NVIDIA H100" in value
    del record["figures"]["hf_continuous"]  # the record as written before transformers ran, its stage then cut
    [(_, value)] = BUILDERS["gpu_bench"](record)
    assert value.startswith("not measured")


@pytest.mark.slow  # five stages, each a process that compiles an engine (about 2 minutes on 2 cores)
def test_the_dry_run_runs_every_stage_and_writes_nothing_into_the_results(tmp_path):
    tag = "dryruntest"
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", "experiments/gpu_bench.sh", tag], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not [f for f in os.listdir(RESULTS_DIR) if tag in f], "a dry run's record in experiments/results"
    names = [f"gpu_bench_{tag}_{p}" for p in ("tiny_llama", "tiny_qwen3", "tiny_llama_untied")]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"{n}.json" for n in names] + [f"gpu_bench_{tag}_peer_hf.json", f"attention_backends_{tag}_bench_f32.json",
                                        "logs.tgz"])
    for name in names:
        record = json.loads((tmp_path / f"{name}.json").read_text())
        fig = record["figures"]
        assert record["environment"]["device"] == fig["device"] == "cpu"
        assert fig["output_tokens_per_s"] > 0 and fig["generated_tokens"] == fig["useful_output_tokens"]
        assert fig["num_compilations_after_warm_up"] == 0
        window = fig["decode_window"]
        assert window["all_steps_full_decode"] and window["num_seqs"] == fig["engine_settings"]["max_num_seqs"] == 4
        assert not window["device"]["available"] and "/host:CPU" in window["device"]["reason"]
        assert window["roofline"]["roofline_ms"] > 0 and window["wall_ms_per_step"] > 0
        assert len(BUILDERS["gpu_bench"](record)) == 3
        assert window["host_phases"]["decode_steps"] == 3 and window["host_phases"]["wall_ms"] > 0
    peer = json.loads((tmp_path / f"gpu_bench_{tag}_peer_hf.json").read_text())["figures"]
    assert peer["hf_continuous"]["generated_tokens"] == peer["useful_output_tokens"]
    assert peer["against"]["same_trace"] and peer["against"]["record"] == names[0]
    f32 = json.loads((tmp_path / f"attention_backends_{tag}_bench_f32.json").read_text())["figures"]
    check = f32["runs"][1][f"against_{f32['runs'][0]['attention_backend']}"]
    assert f32["matmul_precision"] == "highest" and check["mismatches"] == 0
    summary = run.stdout[run.stdout.index("== summary"):]
    assert "no record" not in summary and "unreadable" not in summary
    for name in names + [f"gpu_bench_{tag}_peer_hf", f"attention_backends_{tag}_bench_f32"]:
        assert f"{name}: " in summary


def test_the_jitted_random_weights_are_random_models():
    """Same preset, key and dtype: the same weights as bench_models.random_model's (up to float32
    rounding where XLA fuses a norm's scale and shift), and the same source."""
    import jax
    import numpy as np

    from experiments.bench_models import random_model
    from experiments.gpu_bench import random_weights
    jitted, eager = random_weights("tiny_qwen3", 256, "float32"), random_model("tiny_qwen3", 256, "float32")
    assert jitted.source == eager.source and jitted.config == eager.config
    for a, b in zip(jax.tree.leaves(jitted.params), jax.tree.leaves(eager.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_busy_figures_per_step_and_fractions():
    """10 steps in 0.1 s (10 ms each), 0.125 s traced, 50 ms of device time: 5 ms busy per step,
    0.5 of the untraced step, 0.4 of the traced; no fraction where the trace had no device."""
    from experiments.gpu_bench import busy_figures
    out = busy_figures(0.1, 0.125, 10, {"available": True, "busy_ms": 50.0})
    assert (out["wall_ms_per_step"], out["traced_wall_ms_per_step"], out["device_busy_ms_per_step"]) == (10, 12.5, 5)
    assert (out["device_busy_fraction"], out["device_busy_fraction_traced"]) == (0.5, 0.4)
    failed = busy_figures(0.1, None, 10, {"available": False, "reason": "the profiler failed"})
    assert failed["traced_wall_ms_per_step"] is None and "device_busy_fraction" not in failed


def test_a_gpu_bench_records_rows_name_the_device_and_the_script_that_runs_it():
    """A record as the smollm2 stage writes it on a GPU: its throughput row and decode-window row,
    the device in the value, and `gpu_bench.sh` (not gpu_check.sh) in the command cell."""
    from experiments import results_table
    window = {"num_seqs": 256, "steps": 32, "mean_context": 180.0, "wall_ms_per_step": 9.0,
              "device_busy_fraction": 0.8, "step_over_roofline": 3.0,
              "roofline": {"roofline_ms": 3.0, "bound": "memory", "roofline_output_tokens_per_s": 85333.3},
              "host_phases": {"host_ms": 1.5, "phases_ms": {"schedule": 0.5, "stats": 0.1, "runner_host": 0.4,
                                                            "device": 7.5, "core_update": 0.3, "outputs": 0.2}}}
    record = {"name": "gpu_bench_h100_smollm2_135m",
              "command": "python -m experiments.gpu_bench --output=gpu_bench_h100_smollm2_135m",
              "flags": {"output": "gpu_bench_h100_smollm2_135m"},
              "environment": {"platform": "gpu", "device": "NVIDIA H100 80GB HBM3"},
              "figures": {"engine": "paged_jax", "preset": "smollm2_135m", "dtype": "bfloat16", "workload": "sharegpt",
                          "num_requests": 512, "mean_prompt_tokens": 160.0, "mean_output_tokens": 330.0,
                          "model": "random:smollm2_135m", "setup_s": 60.0, "output_tokens_per_s": 12345.6,
                          "engine_settings": {"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                                              "num_step_programs": 22, "num_blocks": 1000, "block_size": 16,
                                              "async_scheduling": True},
                          "decode_window": window}}
    rows = results_table.table_rows([("gpu_bench_h100_smollm2_135m.json", record)])
    assert len(rows) == 3 and all("NVIDIA H100" in value for _, value, _, _ in rows)
    assert rows[0][1].startswith("12346 ") and "256 sequences / 8192 tokens per step" in rows[0][0]
    assert rows[1][1].startswith("9; 80%; 3 (memory-bound: 3.0x it, 85333 tok/s at it)")
    assert rows[2][0].endswith("schedule / stats / runner host / core update / outputs")
    assert rows[2][1].startswith("0.5 / 0.1 / 0.4 / 0.3 / 0.2 (1.5 in all)")
    assert all("`bash experiments/gpu_bench.sh` runs it" in cell for _, _, cell, _ in rows)
