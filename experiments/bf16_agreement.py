"""How far our bfloat16 engine's greedy outputs and logits are from our float32 engine's.

    python -m experiments.bf16_agreement            # SmolLM2-135M on peer_vllm's trace: 64 requests, outputs <= 120
    python -m experiments.bf16_agreement --model=tiny_llama --num_requests=8 --kv_cache_gib=0.1 --output=bf16_tiny
                                                    # a dry run of the script (random weights)

Why: bf16 weights (and KV cache, with the native attention) are where our CPU speed-up
comes from (experiments/peer_vllm.py --dtype=bfloat16), but peer_vllm only counts bf16
outputs that differ from vLLM's, unchecked; nothing said how much bf16 changes *our*
outputs, or whether a difference is a rounding flip at a near tie or a real drift. The
same trace as peer_vllm / trace_step_breakdown (--num_requests ShareGPT-like requests,
outputs capped at --max_output_tokens, greedy, EOS ignored, all at t=0, the same engine
settings) runs through `LLM.generate` once in float32 and once in bfloat16, both engines
from the same float32 weights (the engine rounds them to bf16), and reports:
  outputs       the fraction of requests whose outputs are equal token for token, the mean
                fraction of each output before its first difference, and where the first
                differences fall (median, quartiles)
  logits        on the first --logit_prompts prompts, each prefilled alone (max_tokens 1),
                the engine's own last-position logits as its step computed them (captured at
                the runner's jitted step): max and mean |bf16 - f32|, top-1 agreement, and for
                each top-1 disagreement the f32 logit gap between the two engines' tokens
  divergences   (--check_divergences) for every request that differs: both engines' logits
                after the common prefix (prompt + the equal tokens), and the gap between the
                two tokens in each: a small f32 gap means bf16 flipped a near tie
Writes experiments/results/<output>.json.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset.")
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"],
                              "experiments/benchmarks/workloads.py trace (peer_vllm's: sharegpt).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests in the trace.")
_MAX_OUTPUT = flags.DEFINE_integer("max_output_tokens", 120, "Cap on each request's output tokens.")
_LOGIT_PROMPTS = flags.DEFINE_integer("logit_prompts", 16, "First prompts whose prefill logits are compared.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "EngineConfig.max_num_seqs.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 1024, "EngineConfig.max_num_batched_tokens "
                                                                   "(peer_vllm's default).")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 2.0, "KV cache budget of each engine, GiB.")
_ATTENTION = flags.DEFINE_string("attention_backend", "auto", "EngineConfig.attention_backend.")
_CHECK = flags.DEFINE_boolean("check_divergences", True, "Compare both engines' logits where outputs first differ.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace and engine seed.")
_OUTPUT = flags.DEFINE_string("output", "bf16_agreement", "Result name: experiments/results/<output>.json.")

DTYPES = ("float32", "bfloat16")
MAX_MODEL_LEN = 2048  # peer_vllm's and trace_step_breakdown's


def _quantiles(values) -> dict:
    if not values:
        return {"min": None, "p25": None, "median": None, "p75": None, "max": None}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"min": min(values), "p25": q[0], "median": statistics.median(values), "p75": q[2], "max": max(values)}


def output_agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict:
    """Equal outputs, the mean fraction of each reference output before the first difference,
    and the first differences' positions (None where equal)."""
    from experiments.benchmarks.vllm_worker import first_difference
    firsts = [first_difference(a, b) for a, b in zip(reference, candidate)]
    fractions = [1.0 if f is None else f / max(len(a), 1) for a, f in zip(reference, firsts)]
    differing = [f for f in firsts if f is not None]
    return {"num_requests": len(firsts), "identical": len(firsts) - len(differing),
            "identical_fraction": round((len(firsts) - len(differing)) / len(firsts), 4),
            "mean_fraction_before_first_difference": round(statistics.mean(fractions), 4),
            "first_difference": _quantiles(differing), "first_differences": firsts}


def logit_closeness(reference, candidate) -> dict:
    """Per-prompt and summary closeness of two engines' logits rows (f32 the reference)."""
    import numpy as np
    rows = []
    for ref, got in zip(reference, candidate):
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
        diff = np.abs(got - ref)
        top_ref, top_got = int(ref.argmax()), int(got.argmax())
        second = np.partition(ref, -2)[-2]
        rows.append({"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                     "top1_agrees": top_ref == top_got, "f32_top1_margin": float(ref[top_ref] - second),
                     "f32_gap_on_disagreement": None if top_ref == top_got else float(ref[top_ref] - ref[top_got]),
                     "mean_abs_f32_logit": float(np.abs(ref).mean())})
    gaps = [r["f32_gap_on_disagreement"] for r in rows if r["f32_gap_on_disagreement"] is not None]
    return {"num_prompts": len(rows), "max_abs_diff": round(max(r["max_abs_diff"] for r in rows), 5),
            "mean_abs_diff": round(statistics.mean(r["mean_abs_diff"] for r in rows), 6),
            "top1_agreement": round(sum(r["top1_agrees"] for r in rows) / len(rows), 4),
            "f32_gaps_on_disagreement": [round(g, 5) for g in gaps],
            "median_f32_top1_margin": round(statistics.median(r["f32_top1_margin"] for r in rows), 5),
            "mean_abs_f32_logit": round(statistics.mean(r["mean_abs_f32_logit"] for r in rows), 4),
            "per_prompt": [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in rows]}


def divergence_gaps(engines, requests, outputs) -> list[dict]:
    """For each request whose outputs differ: each engine's logit of its own token minus the
    other's token, after the common prefix (a small f32 gap: bf16 flipped a near tie)."""
    from experiments.benchmarks.logits_capture import next_token_logits
    from experiments.benchmarks.vllm_worker import first_difference
    found = []
    for i, (r, a, b) in enumerate(zip(requests, outputs["float32"], outputs["bfloat16"])):
        d = first_difference(a, b)
        if d is None or d >= min(len(a), len(b)):
            continue
        prefix = list(r.prompt_token_ids) + list(a[:d])
        row = {"request": i, "position": d, "float32_token": a[d], "bfloat16_token": b[d]}
        for dtype, mine, other in (("float32", a[d], b[d]), ("bfloat16", b[d], a[d])):
            logits, _ = next_token_logits(engines[dtype], prefix)
            row[f"{dtype}_gap"] = round(float(logits[mine] - logits[other]), 5)
        found.append(row)
    return found


def main(argv):
    del argv
    import os

    from experiments.bench_models import load_for_benchmark
    from experiments.benchmarks.logits_capture import next_token_logits
    from experiments.benchmarks.workloads import make_trace, trace_means
    from experiments.reporting.results_io import write_result
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    loaded = load_for_benchmark(_MODEL.value, MAX_MODEL_LEN)  # float32; the bf16 engine rounds these weights
    requests = make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, scale=1.0,
                          max_model_len=MAX_MODEL_LEN, vocab_size=loaded.config.vocab_size)
    requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, _MAX_OUTPUT.value)) for r in requests]
    engines, settings, logits, outputs, runs = {}, {}, {}, {}, {}
    for dtype in DTYPES:
        start = time.perf_counter()
        llm = engines[dtype] = LLM(loaded, max_model_len=MAX_MODEL_LEN, max_num_seqs=_MAX_NUM_SEQS.value,
                                   max_num_batched_tokens=_MAX_BATCHED.value,
                                   kv_cache_memory_bytes=int(_KV_GIB.value * 2**30), dtype=dtype, seed=_SEED.value,
                                   attention_backend=_ATTENTION.value)
        setup_s = time.perf_counter() - start
        config = llm.engine.config
        settings[dtype] = {"attention_backend": config.attention_backend, "kv_cache_dtype": config.kv_cache_dtype,
                           "layer_loop": config.layer_loop, "weight_layout": llm.engine.runner.weight_layout}
        firsts = [next_token_logits(llm, r.prompt_token_ids) for r in requests[:_LOGIT_PROMPTS.value]]
        logits[dtype] = [row for row, _ in firsts]
        argmax_ok = all(int(row.argmax()) == token for row, token in firsts)
        llm.reset_prefix_cache()  # the trace runs as peer_vllm's does: no prompt cached beforehand
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                            [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
                             for r in requests], use_tqdm=True)
        wall = time.perf_counter() - start
        outputs[dtype] = [list(o.outputs[0].token_ids) for o in outs]
        runs[dtype] = {"setup_s": round(setup_s, 1), "wall_s": round(wall, 2),
                       "output_tokens_per_s": round(sum(map(len, outputs[dtype])) / wall, 1),
                       "captured_logits_argmax_is_engine_token": argmax_ok,
                       "num_compilations_after_warm_up": llm.stats()["num_compilations_after_warm_up"],
                       **settings[dtype]}
        print(f"{dtype}: {runs[dtype]['output_tokens_per_s']} output tok/s ({wall:.1f} s; setup {setup_s:.1f} s)",
              flush=True)
    agreement = output_agreement(outputs["float32"], outputs["bfloat16"])
    closeness = logit_closeness(logits["float32"], logits["bfloat16"])
    figures = {"model": loaded.source, "workload": _WORKLOAD.value,
               "useful_output_tokens": sum(r.max_tokens for r in requests),
               **trace_means(requests, digits=1),
               "runs": runs, "outputs": agreement, "logits": closeness, "load_average_end": os.getloadavg()}
    if _CHECK.value:
        gaps = divergence_gaps(engines, requests, outputs)
        medians = {f"median_{d}_gap": _quantiles([g[f"{d}_gap"] for g in gaps])["median"] for d in DTYPES}
        figures["divergences"] = {"rows": gaps, **{k: v if v is None else round(v, 5) for k, v in medians.items()}}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    q = agreement["first_difference"]
    print(f"outputs: {agreement['identical']}/{agreement['num_requests']} identical; "
          f"{agreement['mean_fraction_before_first_difference']:.1%} of each output before its first difference; "
          f"first differences at median {q['median']} (p25 {q['p25']}, p75 {q['p75']})")
    print(f"first-token logits on {closeness['num_prompts']} prompts: max |diff| {closeness['max_abs_diff']}, mean "
          f"|diff| {closeness['mean_abs_diff']}, top-1 agreement {closeness['top1_agreement']:.0%}, f32 gaps on "
          f"disagreement {closeness['f32_gaps_on_disagreement']} (median f32 top-1 margin "
          f"{closeness['median_f32_top1_margin']})")
    if "divergences" in figures:
        d = figures["divergences"]
        print(f"at the {len(d['rows'])} first differences: median gap between the two tokens in f32 logits "
              f"{d['median_float32_gap']}, in bf16 logits {d['median_bfloat16_gap']}")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
