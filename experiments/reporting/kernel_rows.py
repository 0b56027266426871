"""Results-table rows (docs/results.md) of the attention kernels' records: bench_kernel (CPU or GPU) and
attention_backends (the engine end to end under each attention backend).

On a GPU the figures that matter are the kernel against dense attention over contiguous
K/V (the same math with no block table) and against the device's measured memory
bandwidth; on CPU, the Pallas kernel in interpret mode against its jnp reference.
"""

from __future__ import annotations

from experiments.reporting.results_rows import _cpu_note, _join, _span, model_label, workload_label


def _shape(points) -> str:
    heads = _span(f"{p['num_heads']} query / {p['num_kv_heads']} KV heads x {p['head_dim']}" for p in points)
    return f"{heads}, block {_span(p['block_size'] for p in points)}, {_span(p['dtype'] for p in points)}"


def _batches(points) -> str:
    return "; ".join(f"{p['num_seqs']} x {p['context_len']}" + (f" ({p['num_heads']}/{p['num_kv_heads']})"
                                                                 if len({q['num_heads'] for q in points}) > 1 else "")
                     for p in points)


def _short_label(name: str) -> str:
    """'paged_attention@c128-r16-w4-s2-k8' -> 'c128-k8' (TritonTuning's field defaults left out),
    'paged_attention' -> 'default'."""
    if "@" not in name:
        return "default"
    return "-".join(part for part in name.split("@")[1].split("-") if part not in ("w4", "s2") and part[0] != "r")


def _incomplete_note(record: dict) -> str:
    """For a run cut short by its time limit (bench_kernel writes after each batch): how many
    batches of the flags' grid it has."""
    fig, flags = record["figures"], record.get("flags", {})
    if not fig.get("incomplete"):
        return ""
    grid = 1
    for name in ("block_size", "num_seqs", "context_len", "num_heads", "dtype"):
        grid *= len(flags.get(name) or [None])
    return f"; cut short by its time limit: {len(fig['points'])} of {grid} batches"


def _timing_note(record: dict) -> str:
    """For a GPU record timed before calls were chained on the device (no figures.timing)."""
    if "timing" not in record["figures"]:
        return "; calls dispatched one by one from Python, dense attention over token-major K/V"
    return ""


def bench_kernel(record: dict) -> list:
    fig = record["figures"]
    points = fig["points"]
    if "ceilings" not in fig:  # a CPU record: the interpret-mode kernel against its reference
        return [((f"ragged kernel / jnp reference, decode, {_shape(points)}: {_span(p['num_seqs'] for p in points)} "
                  f"seqs x context {_span(p['context_len'] for p in points)}"),
                 _join((p["ragged_paged_attention_over_reference"] for p in points), "{:.2f}", ", ")
                 + _cpu_note(record))]
    bandwidth = fig["ceilings"]["memory"]["GB_per_s"]
    note = _cpu_note(record) + _timing_note(record) + _incomplete_note(record)
    rows = [((f"paged decode kernel / dense attention over contiguous K/V, {_shape(points)}, sequences x context: "
              f"{_batches(points)}"),
             _join((p.get("paged_attention_over_dense", "error") for p in points), "{}", ", ") + note),
            ((f"paged decode kernel, share of the memory bandwidth measured beside it ({bandwidth:.0f} GB/s, "
              f"read + write of a copy), same batches"),
             _join((p["paged_attention"].get("fraction_of_bandwidth", "error") for p in points), "{}", ", ") + note)]
    if all("ms" in p.get("jax_upstream_paged_attention", {}) for p in points):
        rows.append(("time of JAX's own Pallas GPU paged attention (jax.experimental.pallas.ops.gpu) / ours, same "
                     "batches",
                     _join((round(p["jax_upstream_paged_attention"]["ms"] / p["paged_attention"]["ms"], 2)
                            for p in points), "{}", ", ") + note))
    if fig.get("tunings"):  # a sweep: the decode kernel's fastest launch per batch
        def fastest(p):
            ours = {k: v for k, v in p.items() if (k == "paged_attention" or k.startswith("paged_attention@"))
                    and isinstance(v, dict) and "ms" in v}
            best = min(ours, key=lambda k: ours[k]["ms"])
            default = p["paged_attention"].get("ms")
            return f"{_short_label(best)} {ours[best]['ms']:.4f} ({'error' if default is None else f'{default:.4f}'})"
        rows.append(("paged decode kernel's fastest TritonTuning per batch, ms (the default's ms), same batches",
                     _join((fastest(p) for p in points), "{}", ", ") + note))
    # bench_kernel times the prefill batch once per decode point: the first of each shape
    shapes = {(p["num_seqs"], p["q_len"], p["context_len"], p["num_heads"], p["num_kv_heads"]): p
              for p in reversed(fig.get("prefill_points") or [])}
    prefill = list(reversed(shapes.values()))
    if prefill:
        rows.append((("ragged kernel / dense causal attention, prefill chunks: "
                      + "; ".join(f"{p['num_seqs']} x {p['q_len']} of {p['context_len']} ({p['num_heads']}/"
                                  f"{p['num_kv_heads']} heads)" for p in prefill)),
                     _join((f"{p['ragged_paged_attention_over_dense']} ({p['ragged_paged_attention']['TFLOP_per_s']} "
                            f"TFLOP/s)" for p in prefill), "{}", ", ") + note))
    return rows


def attention_backends(record: dict) -> list:
    fig = record["figures"]
    runs = fig["runs"]
    truth = runs[0]["attention_backend"]
    precision = "" if fig.get("matmul_precision", "default") == "default" else f", {fig['matmul_precision']} matmuls"
    setting = (f"{model_label(fig['model'])}, {fig['num_requests']} {workload_label(fig['workload'])} requests "
               f"(mean prompt {fig['mean_prompt_tokens']:.0f}, output {fig['mean_output_tokens']:.0f}), "
               f"{_span(r['dtype'] for r in runs)}{precision}")
    note = _cpu_note(record)
    rows = [(f"engine end to end, {setting}, output tok/s: " + " / ".join(r["attention_backend"] for r in runs),
             _join((r["output_tokens_per_s"] for r in runs), "{:.0f}") + note)]
    for r in runs[1:]:
        c = r[f"against_{truth}"]
        value = f"{c['identical']}/{c['num_requests']} equal"
        differences = c["differences"]
        if differences:
            gaps = [abs(d["reference_logit_gap"]) for d in differences if "reference_logit_gap" in d]
            spread = differences[0].get("reference_logit_std")
            value += (f"; the other {len(differences)} first differ where {truth}'s logits for the two tokens are "
                      f"at most {max(gaps):.3f} apart" + (f" (logit std {spread:.1f})" if spread else "")
                      + f"; {c['near_ties']} within the f32 rule's 1e-3")
        rows.append((f"same, {r['attention_backend']}'s greedy outputs against {truth}'s", value))
    return rows
