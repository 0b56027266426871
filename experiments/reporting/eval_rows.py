"""Results-table row (docs/results.md) of the lm-evaluation-harness run against our server (experiments/lm_eval_run.py):
what lm-eval reported, and how its inputs from us compared with transformers' and with our
own offline engine.

Split from results_rows.py as peer_rows.py is (results_rows imports it into BUILDERS after
defining the shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def _metrics(metrics: dict) -> str:
    """'paged_jax_mc acc 0.875 ± 0.125, paged_jax_generate exact_match 0 ± 0': every metric lm-eval
    reports per task ("name,filter"; the filter named unless it is "none"), with its stderr."""
    parts = []
    for task, values in metrics.items():
        for key, value in values.items():
            name, _, filt = key.partition(",")
            if not filt or name.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            stderr = values.get(f"{name}_stderr,{filt}")
            label = name if filt == "none" else f"{name} ({filt})"
            parts.append(f"{task} {label} {value:.3g}"
                         + (f" ± {stderr:.2g}" if isinstance(stderr, (int, float)) else ""))
    return ", ".join(parts) or "no metrics"


def lm_eval_run(record: dict) -> list:
    """lm-eval's metrics; our loglikelihoods against transformers' on the same weights, and
    the multiple-choice accuracy from transformers' against lm-eval's; our generations
    against the offline engine's; the lm-eval run's wall time."""
    fig, flags = record["figures"], record["flags"]
    ll = fig["loglikelihoods"]
    tasks = fig.get("tasks") or list(fig["metrics"])
    value = [_metrics(fig["metrics"])]
    if ll["num_requests"]:
        value.append(f"{ll['num_requests']} loglikelihoods: max |ours - transformers| {ll['max_abs_diff']:.2g}, "
                     f"mean {ll['mean_abs_diff']:.2g}")
    for task, acc in (ll.get("accuracy") or {}).items():
        same = "equal to" if acc["transformers_equals_lm_eval"] else "differs from"
        value.append(f"{task} acc from transformers' loglikelihoods {acc['from_transformers_loglikelihoods']:.3g}, "
                     f"{same} lm-eval's (the same choice as ours in {acc['same_prediction_docs']}/{acc['docs']} docs)")
    if fig.get("generations"):
        value.append(f"{fig['generations_equal_to_offline']}/{fig['generations_checked']} generations equal to the "
                     f"offline engine's")
    value.append(f"lm-eval run {fig['lm_eval_wall_s']:.0f} s" + rr._cpu_note(record))
    return [((f"lm-evaluation-harness {fig.get('lm_eval_version')} (local-completions, tokenizer "
              f"{fig.get('tokenizer_backend', flags.get('tokenizer_backend'))}, batch {flags.get('batch_size')}) "
              f"against our server, {rr.model_label(fig.get('model'))}, tasks {rr._join(tasks)}: lm-eval's metrics; "
              f"every loglikelihood lm-eval got vs transformers' on the same weights; multiple-choice accuracy "
              f"recomputed from transformers'; generations vs our offline greedy engine; wall time"),
             "; ".join(value))]


# structured outputs' cost on the step (experiments/structured_outputs_overhead.py)
_SO_MODES = {"json": "JSON schema", "json_compact": "JSON schema, disable_any_whitespace"}


def _signed_pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def structured_outputs_overhead(record: dict) -> list:
    """Median decode step with every row under a JSON schema vs none, at the same rows and
    output positions: the overhead of the step and of its parts, per mode; the per-round
    overheads (the runs alternate); the grammar's compile time, apart from the steps."""
    fig, flags = record["figures"], record["flags"]
    modes = [m for m in fig["modes"] if m in fig["overhead"]]
    parts = []
    for mode in modes:
        o = fig["overhead"][mode]
        per_round = " / ".join(_signed_pct(r[f"{mode}_overhead"]["step_overhead_fraction"]) for r in fig["rounds"])
        parts.append(f"{_SO_MODES.get(mode, mode)}: {o[mode]['step_ms']:.1f} vs {o['unconstrained']['step_ms']:.1f} "
                     f"ms = {_signed_pct(o['step_overhead_fraction'])} over {o[mode]['steps']} steps (rounds "
                     f"{per_round}); parts {_signed_pct(o['parts_overhead_fraction'])}: host bitmask "
                     f"{o['bitmask_ms']:.2f} ms, matcher advance {o['accept_ms_delta']:+.2f}, masked head "
                     f"{o['head_ms_delta']:+.2f}, batch preparation {o['prepare_ms_delta']:+.2f} ms")
    grammar = fig["grammar"]
    compiles = " / ".join(f"{1e3 * grammar[m]['first_check_s']:.1f}" for m in modes if m in grammar)
    parts.append(f"first request's grammar compile {compiles} ms, llguidance tokenizer "
                 f"{grammar['ll_tokenizer_build_s']:.2f} s once per engine; target <= "
                 f"{_signed_pct(fig['target_overhead_fraction'])}" + rr._cpu_note(record))
    return [((f"structured outputs, {rr.model_label(fig.get('model'))} {fig.get('dtype')}, {fig['num_seqs']} greedy "
              f"rows: median decode step with all {fig['num_seqs']} rows decoding, each under "
              f"{' / '.join(_SO_MODES.get(m, m) for m in modes)} ({len(fig['schema']['properties'])}-field object) vs "
              f"unconstrained at the same output positions, {flags.get('rounds')} alternated rounds; overhead of "
              f"the step and of its parts"), "; ".join(parts))]
