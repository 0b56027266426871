"""The engine end to end under each attention backend: output tok/s and greedy agreement.

    python -m experiments.attention_backends --backends=reference,pallas --dtypes=bfloat16,float32
                        # on a GPU: the Pallas (Triton) kernel against the jnp reference
    python -m experiments.attention_backends --model=tiny_llama --num_requests=8 --backends=native,reference
                        # a dry run of the script on CPU (random weights)

Why: a kernel that passes its unit tests must also serve: the same trace (ShareGPT-like,
--num_requests requests at t=0, outputs capped at --max_output_tokens, greedy, EOS
ignored) runs through `LLM.generate` on one engine per (dtype, backend), rounds
alternating the backends (A B A B) so drift falls on both. Every backend's outputs are
compared token for token with the first backend's (the ground truth, normally
"reference"); where one differs, the first backend's engine scores the common prefix and
the gap between its logits for the two tokens is recorded: a gap under --tie_tolerance
is a near tie that float rounding may flip, anything larger a real mismatch. Also
recorded: warm-up time, compilations after warm-up (must be 0) and the resolved
settings. `--model=random:<preset>` runs a configs preset (e.g. smollm2_135m) with random
weights, for machines that cannot carry the real ones. Writes
experiments/results/<output>.json.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from absl import app, flags

# flags are defined only when run (see the end): importing this module (the tests) defines
# none, so it cannot clash with another experiment's flags in one process
def _define_flags():
    flags.DEFINE_string("model", "smollm2-135m",
                        "Model: any load_model source, a tiny_* preset or random:<preset> (random weights).")
    flags.DEFINE_list("backends", ["reference", "pallas"],
                      "EngineConfig.attention_backend values; the first is the ground truth.")
    flags.DEFINE_list("dtypes", ["bfloat16"], "EngineConfig.dtype values (each its own engines).")
    flags.DEFINE_integer("num_requests", 64, "Requests in the trace (ShareGPT-like, all at t=0).")
    flags.DEFINE_integer("max_output_tokens", 120, "Cap on each request's output tokens.")
    flags.DEFINE_integer("rounds", 2, "Runs of the trace per engine, alternating the backends.")
    flags.DEFINE_integer("max_num_seqs", 64, "EngineConfig.max_num_seqs.")
    flags.DEFINE_integer("max_num_batched_tokens", 1024, "EngineConfig.max_num_batched_tokens.")
    flags.DEFINE_list("seq_buckets", [], "EngineConfig.seq_buckets (empty: the defaults).")
    flags.DEFINE_list("token_buckets", [], "EngineConfig.token_buckets (empty: the defaults).")
    flags.DEFINE_float("kv_cache_gib", 2.0, "KV cache budget of each engine, GiB.")
    flags.DEFINE_float("tie_tolerance", 1e-3, "Largest logit gap that counts as a near tie.")
    flags.DEFINE_enum("matmul_precision", None, ["default", "high", "highest"],
                      "jax_default_matmul_precision for the run (GPUs multiply f32 in TF32 by default: "
                      "'highest' makes f32 engines exact enough for the near-tie rule).")
    flags.DEFINE_integer("seed", 0, "Trace and engine seed.")
    flags.DEFINE_string("output", "attention_backends", "Result name: experiments/results/<output>.json.")


FLAGS = flags.FLAGS
MAX_MODEL_LEN = 2048  # peer_vllm's and trace_step_breakdown's


def compare(reference_llm, requests, reference: list[list[int]], candidate: list[list[int]],
            tie_tolerance: float) -> dict:
    """Equal outputs, and at each first difference the reference engine's logit gap
    between its token and the candidate's after the common prefix."""
    import numpy as np

    from experiments.benchmarks.logits_capture import next_token_logits
    from experiments.benchmarks.vllm_worker import first_difference
    rows = []
    for i, (r, a, b) in enumerate(zip(requests, reference, candidate)):
        d = first_difference(a, b)
        if d is None:
            continue
        if d >= min(len(a), len(b)):
            rows.append({"request": i, "position": d, "length_differs": True, "near_tie": False})
            continue
        logits, _ = next_token_logits(reference_llm, list(r.prompt_token_ids) + list(a[:d]))
        gap = float(logits[a[d]] - logits[b[d]])
        top2 = np.partition(logits, -2)[-2:]
        rows.append({"request": i, "position": d, "reference_token": a[d], "candidate_token": b[d],
                     "reference_logit_gap": round(gap, 6), "near_tie": abs(gap) <= tie_tolerance,
                     "reference_top2_margin": round(float(top2[1] - top2[0]), 6),
                     "reference_logit_std": round(float(logits.std()), 4)})
    return {"num_requests": len(reference), "identical": len(reference) - len(rows),
            "near_ties": sum(r["near_tie"] for r in rows), "mismatches": sum(not r["near_tie"] for r in rows),
            "differences": rows}


def main(argv):
    del argv
    import os

    import jax

    from experiments.bench_models import load_for_benchmark
    from experiments.benchmarks.workloads import make_trace, trace_means
    from experiments.reporting.results_io import write_result
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    if FLAGS.matmul_precision:
        jax.config.update("jax_default_matmul_precision", FLAGS.matmul_precision)
    loaded = load_for_benchmark(FLAGS.model, MAX_MODEL_LEN)
    requests = make_trace("sharegpt", FLAGS.num_requests, seed=FLAGS.seed, scale=1.0,
                          max_model_len=MAX_MODEL_LEN,
                          vocab_size=loaded.config.vocab_size)
    requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, FLAGS.max_output_tokens)) for r in requests]
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    buckets = {name: tuple(int(b) for b in flag) for name, flag in
               (("seq_buckets", FLAGS.seq_buckets), ("token_buckets", FLAGS.token_buckets)) if flag}
    runs = []
    for dtype in FLAGS.dtypes:
        engines, outputs, rates = {}, {}, {b: [] for b in FLAGS.backends}
        for backend in FLAGS.backends:
            start = time.perf_counter()
            engines[backend] = LLM(loaded, max_model_len=MAX_MODEL_LEN, max_num_seqs=FLAGS.max_num_seqs,
                                   max_num_batched_tokens=FLAGS.max_num_batched_tokens, dtype=dtype, seed=FLAGS.seed,
                                   kv_cache_memory_bytes=int(FLAGS.kv_cache_gib * 2**30), attention_backend=backend,
                                   **buckets)
            print(f"{dtype} {backend}: engine ready in {time.perf_counter() - start:.1f} s", flush=True)
            rates[backend].append(round(time.perf_counter() - start, 1))  # the first entry: setup seconds
        for round_index in range(FLAGS.rounds):
            for backend in FLAGS.backends:
                llm = engines[backend]
                llm.reset_prefix_cache()  # every round starts cold, as the first did
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - start
                outputs[backend] = [list(o.outputs[0].token_ids) for o in outs]
                rates[backend].append(round(sum(map(len, outputs[backend])) / wall, 1))
                print(f"{dtype} {backend} round {round_index}: {rates[backend][-1]} output tok/s ({wall:.2f} s)",
                      flush=True)
        truth = FLAGS.backends[0]
        for backend in FLAGS.backends:
            llm, config = engines[backend], engines[backend].engine.config
            row = {"dtype": dtype, "attention_backend": config.attention_backend,
                   "kv_cache_dtype": config.kv_cache_dtype, "layer_loop": config.layer_loop,
                   "setup_s": rates[backend][0], "output_tokens_per_s_per_round": rates[backend][1:],
                   "output_tokens_per_s": statistics.median(rates[backend][1:]),
                   "num_compilations_after_warm_up": llm.stats()["num_compilations_after_warm_up"]}
            if backend != truth:
                row["against_" + truth] = compare(engines[truth], requests, outputs[truth], outputs[backend],
                                                  FLAGS.tie_tolerance)
            runs.append(row)
        del engines
    figures = {"model": loaded.source, "device": jax.devices()[0].device_kind, "workload": "sharegpt",
               "matmul_precision": FLAGS.matmul_precision or "default",
               "num_requests": len(requests), "useful_output_tokens": sum(r.max_tokens for r in requests),
               **trace_means(requests, digits=1),
               "engine_settings": {"max_num_seqs": FLAGS.max_num_seqs,
                                   "max_num_batched_tokens": FLAGS.max_num_batched_tokens,
                                   "kv_cache_gib": FLAGS.kv_cache_gib, **{k: list(v) for k, v in buckets.items()}},
               "runs": runs, "load_average_end": os.getloadavg()}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    print("wrote", write_result(FLAGS.output, flags=flag_values, figures=figures, seed=FLAGS.seed))
    print(f"\n{'dtype':>9} {'backend':>10} {'tok/s':>8} {'setup s':>8} {'equal':>6} {'ties':>5} {'mismatch':>8}")
    for r in runs:
        c = r.get("against_" + FLAGS.backends[0], {})
        print(f"{r['dtype']:>9} {r['attention_backend']:>10} {r['output_tokens_per_s']:>8} {r['setup_s']:>8} "
              f"{c.get('identical', '-'):>6} {c.get('near_ties', '-'):>5} {c.get('mismatches', '-'):>8}")


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
