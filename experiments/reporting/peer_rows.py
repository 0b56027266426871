"""Results-table rows (docs/results.md) of the peer comparisons: transformers (peer_hf), vLLM's CPU backend
(peer_vllm), where our own time on the vLLM trace goes (trace_step_breakdown), the
CPU matmul layouts behind it (weight_layout), how far the served step is from this CPU's
roofline (roofline), and what bf16 changes in our own outputs (bf16_agreement).

Split from results_rows.py (which imports these into its BUILDERS after defining the
shared helpers, `rr.*` here, read at call time).
"""

from __future__ import annotations

from experiments.reporting import results_rows as rr


def peer_hf(record: dict) -> list:
    fig, flags = record["figures"], record["flags"]
    words = {"static": f"HF static batches of {flags.get('batch_size')}", "continuous": "HF continuous batching",
             "paged_jax": "paged_jax"}
    modes = [m for m in flags.get("modes", []) if m in fig]
    checks = [v["greedy_check"] for k, v in fig.items() if k.startswith("paged_jax_vs_") and "greedy_check" in v]
    if checks and all(c["mismatch"] == 0 and c["near_tie"] == 0 for c in checks):
        equal = "; outputs equal token for token"
    else:
        equal = "".join(f"; {c['equal']} equal, {c['near_tie']} near ties, {c['mismatch']} mismatches" for c in checks)
    return [((f"transformers on the same {flags['num_requests']} {rr.workload_label(flags.get('workload'))} requests "
             f"(scale {flags.get('scale')}), {rr.model_label(fig.get('model'))}, useful output tok/s: "
             f"{rr._join(words.get(m, m) for m in modes)}"),
             rr._join((fig[m]["output_tokens_per_s"] for m in modes), "{:.1f}") + equal + rr._cpu_note(record))]


def peer_vllm(record: dict) -> list:
    """vLLM's CPU backend against ours (experiments/peer_vllm.py): output tok/s (means over the
    rounds) per vLLM mode and ours, the ratios (the first mode's also per round), and how our
    outputs compared with vLLM's."""
    fig, flags = record["figures"], record["flags"]
    summary = fig["summary"]
    words = {"both_cores": "vLLM on all cores", "default": "vLLM as set up by default (a core reserved)"}
    modes = [m for m in flags.get("vllm_modes", []) if isinstance(summary.get(m), dict)]
    check = fig["greedy_check"]
    ours = [c for label, c in check["runs"].items() if label.startswith("paged_jax")]
    total = {k: sum(c[k] for c in ours) for k in ("equal", "near_tie", "mismatch", "unchecked")}
    if ours and total["equal"] == sum(total.values()):
        equal = "; outputs equal token for token"
    else:
        equal = (f"; paged_jax outputs vs vLLM's: {total['equal']} equal, {total['near_tie']} near ties, "
                 f"{total['mismatch']} mismatches" + (f", {total['unchecked']} differ (unchecked, "
                                                       f"{fig.get('dtype')})" if total["unchecked"] else ""))
    version = (fig.get("versions") or {}).get("vllm", "")
    return [((f"vLLM {version} CPU backend on the same {flags['num_requests']} "
              f"{rr.workload_label(flags.get('workload'))} requests (scale {flags.get('scale')}: prompts "
              f"{fig['mean_prompt_tokens']:.0f}, outputs {fig['mean_output_tokens']:.0f} tokens), "
              f"{rr.model_label(fig.get('model'))}, {fig.get('dtype')}, max_num_seqs {flags.get('max_num_seqs')}, "
              f"{flags.get('rounds')} rounds, output tok/s: {rr._join(words.get(m, m) for m in modes)} / paged_jax"),
             rr._join([summary[m]["vllm_mean_output_tokens_per_s"] for m in modes]
                   + [summary["paged_jax_mean_output_tokens_per_s"]], "{:.1f}")
             + "; paged_jax / vLLM " + rr._join((summary[m]["ratio"] for m in modes), "{:.2f}x")
             + _per_round(summary, modes) + equal + rr._cpu_note(record))]


def _per_round(summary: dict, modes: list) -> str:
    """The first vLLM mode's ratio round by round: the host drifts, and the spread says how
    far one run's ratio can be trusted."""
    rounds = summary[modes[0]].get("ratio_per_round") if modes else None
    return f" (per round vs {modes[0]}: {rr._join(rounds, '{:.2f}')})" if rounds and len(rounds) > 1 else ""


def trace_step_breakdown(record: dict) -> list:
    """Output tok/s per token budget, and the best budget's split into decode and mixed steps."""
    fig, flags = record["figures"], record["flags"]
    runs = fig["runs"]
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return [((f"paged_jax alone on peer_vllm's trace, {rr._setting(record)}, outputs capped at "
              f"{flags.get('max_output_tokens')}, {fig.get('dtype')}, attention {best['attention_backend']}, KV "
              f"{best['kv_cache_dtype']}, layers {best['layer_loop']}: output tok/s at max_num_batched_tokens "
              + rr._join(r["max_num_batched_tokens"] for r in runs) + "; the best's wall = decode + mixed steps"),
             rr._join((r["output_tokens_per_s"] for r in runs), "{:.1f}")
             + f"; {best['wall_s']:.1f} s = {best['decode_s']:.1f} + {best['mixed_s']:.1f} s" + rr._cpu_note(record))]


def weight_layout(record: dict) -> list:
    """GFLOP/s of SmolLM2's projection shapes per weight layout, by dtype and rows."""
    rows = record["figures"]["rows"]
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        layouts = [v for v in ("in_out", "out_in", "amx_tiles", "f32_columns") if f"{v}_gflops" in mine[0]]
        value = "; ".join(f"{r['shape']} x {r['rows']} rows: " + rr._join((r[f"{v}_gflops"] for v in layouts), "{:.0f}")
                          for r in mine)
        out.append((f"matmul GFLOP/s on this CPU, {dtype} weights, 30 distinct weights per shape (from memory), "
                    f"by weight layout: " + " / ".join(layouts), value + rr._cpu_note(record)))
    return out


def roofline(record: dict) -> list:
    """Per dtype: each timed step's achieved GFLOP/s and GB/s as fractions of the measured
    matmul ceiling at its row count and of the read bandwidth."""
    fig = record["figures"]
    out = []
    for dtype in dict.fromkeys(s["dtype"] for s in fig["steps"]):
        mine = [s for s in fig["steps"] if s["dtype"] == dtype]
        shapes = rr._join((f"{s['seqs']} seqs" if s["kind"] == "decode" else f"{s['tokens']} tokens" for s in mine))
        value = "; ".join(f"{s['kind']} {s['seqs'] if s['kind'] == 'decode' else s['tokens']}: {s['step_ms']:.1f} ms, "
                          f"{s['achieved_gflops']:.0f} GFLOP/s ({rr._pct(s['fraction_of_ceiling'])} of "
                          f"{s['ceiling_gflops']:.0f}), {s['achieved_gbs']:.1f} GB/s "
                          f"({rr._pct(s['fraction_of_bandwidth'])}), {s['step_over_roofline']:.1f}x the {s['bound']} "
                          f"bound" + _serial(s) for s in mine)
        out.append((f"roofline of the served step, {rr.model_label(fig.get('model'))}, {dtype} (weights "
                    f"{mine[0].get('weight_layout')}, KV {mine[0].get('kv_cache_dtype')}), decode at "
                    f"{record['flags'].get('context_len')} context tokens and prefill chunks, {shapes}: step time, "
                    f"matmul GFLOP/s (of the measured matmul ceiling at the step's rows), GB/s of weights + KV read "
                    f"(of "
                    f"{fig['bandwidth_gbs']:.1f} GB/s measured read bandwidth), step time / roofline bound"
                    + (", step time / serial bound (matmuls at the ceiling, then attention at bandwidth or ceiling) "
                       "and the ceiling fraction that bound allows" if any("serial_bound_ms" in s for s in mine) else ""),
                    value + rr._cpu_note(record)))
    return out


def _serial(step: dict) -> str:
    """The serial-bound part of a roofline step's text (records before it have none)."""
    if "serial_bound_ms" not in step:
        return ""
    return (f", {step['step_over_serial_bound']:.2f}x the serial bound (which allows "
            f"{rr._pct(step['max_fraction_of_ceiling'])})")


def bf16_agreement(record: dict) -> list:
    """Our bf16 engine's greedy outputs and first-token logits against our f32 engine's."""
    fig, flags = record["figures"], record["flags"]
    o, lg = fig["outputs"], fig["logits"]
    q = o["first_difference"]
    where = (f"; first differences at token {q['median']:g} (median; quartiles {q['p25']:g}-{q['p75']:g})"
             if q["median"] is not None else "")
    gaps = lg["f32_gaps_on_disagreement"]
    flips = (f", f32 gap between the two tokens {rr._join(gaps, '{:.3g}', ', ')}" if gaps else "")
    div = fig.get("divergences")
    near = (f"; at the first differences the two tokens' f32 logits differ by {div['median_float32_gap']:.3g} "
            f"(median)" if div and div.get("median_float32_gap") is not None else "")
    return [((f"our engine in bfloat16 vs float32, greedy, on peer_vllm's trace ({o['num_requests']} "
              f"{rr.workload_label(fig.get('workload'))} requests, outputs capped at {flags.get('max_output_tokens')}, "
              f"EOS ignored), {rr.model_label(fig.get('model'))}: outputs equal token for token; share of each "
              f"output before its first difference; first-token logits on the first {lg['num_prompts']} prompts"),
             f"{o['identical']}/{o['num_requests']} equal; {rr._pct(o['mean_fraction_before_first_difference'])}"
             f"{where}; logits max |bf16 - f32| {lg['max_abs_diff']:.3g}, mean {lg['mean_abs_diff']:.3g} (mean "
             f"|f32 logit| {lg['mean_abs_f32_logit']:.3g}), top-1 agreement {rr._pct(lg['top1_agreement'])}{flips}"
             f"{near}")]


def ab_revisions(record: dict) -> list:
    """Two revisions (or settings) of paged_jax on one trace, A B A B: each side's best output tok/s."""
    fig = record["figures"]
    sides = fig["revisions"]

    def side(s):
        engine = ", ".join(f"{k}={v}" for k, v in sides[s]["engine"].items())
        return f"{sides[s]['revision']} ({sides[s]['commit'][:7]}{', ' + engine if engine else ''})"
    equal = "outputs equal token for token" if fig["outputs_equal"] else "outputs DIFFER"
    return [((f"A/B of revisions, {fig['num_requests']} ShareGPT-like requests (output cap {fig['max_output_tokens']}), "
              f"{rr.model_label(fig.get('model'))}: A {side('a')} / B {side('b')}{rr._cpu_note(record)}"),
             f"{fig['best_output_tokens_per_s']['a']:.1f} / {fig['best_output_tokens_per_s']['b']:.1f} output tok/s "
             f"(B/A {fig['b_over_a']:.3f}); {equal}")]
