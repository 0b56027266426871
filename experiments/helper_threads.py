"""What the native kernels' spinning helper threads are worth on a served step.

    python -m experiments.helper_threads              # SmolLM2-135M, f32 and bf16, decode 64 / prefill 256
    python -m experiments.helper_threads --model=tiny_llama --rounds=1 --iters=1 --output=helper_threads_tiny
                                                      # a dry run (random weights, figures meaningless)

Why: a decode step makes about 200 short native kernel calls. Each call shares its work
items with helper threads (cpu_kernels/helper_threads.h): by default the library's own,
which spin for a short window between calls, or with a window of 0 XLA's intra-op pool,
whose idle threads sleep and, in a virtual machine, wake slowly. This builds the engine
for each --dtypes value and times its real step (`ModelRunner.run_batch` on hand-built
batches with real block tables: decode steps of --decode_seqs sequences at --context_len
tokens, prefill chunks of --prefill_tokens tokens of one prompt) under each --spin_us
window in turn, --rounds times (the host drifts by 15-30% over minutes, so each round
times every window back to back). Per shape and window: the median step over the rounds
(each round's is the median of --iters steps), and the speedup over the first window as
the median of the rounds' own ratios. Writes experiments/results/<output>.json.
"""

from __future__ import annotations

import functools
import statistics

from absl import app, flags

from experiments.benchmarks.step_batches import build_batch, median_ms, cdiv

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "EngineConfig.dtype values to measure.")
_DECODE_SEQS = flags.DEFINE_list("decode_seqs", ["64"], "Sequences per decode step (one token each).")
_PREFILL_TOKENS = flags.DEFINE_list("prefill_tokens", ["256"], "Tokens per prefill chunk (one prompt); empty: none.")
_CONTEXT_LEN = flags.DEFINE_integer("context_len", 256, "Tokens in the cache of every decoding sequence.")
_SPIN_US = flags.DEFINE_list("spin_us", ["0", "300"], "Helper spin windows in microseconds, the first the baseline "
                                                       "(0: XLA's intra-op pool).")
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Rounds; each times every window once.")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed steps per window and round (median), after one untimed step.")
_OUTPUT = flags.DEFINE_string("output", "helper_threads", "Result name: experiments/results/<output>.json.")


def summarize(kind: str, seqs: int, tokens: int, windows: list[int], rounds: list[dict]) -> dict:
    """One shape's record: per window the rounds' step times and their median, and the
    speedup over windows[0] as the median of the rounds' ratios."""
    base = windows[0]
    out = {"kind": kind, "seqs": seqs, "tokens": tokens, "windows": {}}
    for w in windows:
        times = [r[w] for r in rounds]
        out["windows"][str(w)] = {"step_ms": round(statistics.median(times), 2),
                                  "step_ms_rounds": [round(t, 2) for t in times]}
        if w != base:
            out["windows"][str(w)]["speedup"] = round(statistics.median(r[base] / r[w] for r in rounds), 3)
    return out


def measure_dtype(model, dtype: str, windows: list[int], rng) -> list:
    from cpu_kernels import helper_threads
    from paged_jax.entrypoints.llm import LLM
    decode = [int(s) for s in _DECODE_SEQS.value]
    prefill = [int(t) for t in _PREFILL_TOKENS.value if t]
    ctx, bs = _CONTEXT_LEN.value, 16
    llm = LLM(model, dtype=dtype, block_size=bs, max_model_len=max([ctx] + prefill),
              num_blocks=max([n * cdiv(ctx, bs) for n in decode] + [cdiv(t, bs) for t in prefill]) + 1,
              max_num_seqs=max(decode), max_num_batched_tokens=max(decode + prefill), enable_prefix_caching=False,
              seq_buckets=tuple(sorted(set(decode))), token_buckets=tuple(sorted(set(decode + prefill))))
    runner = llm.engine.runner
    cases = [("decode", [1] * n, [ctx - 1] * n) for n in decode] + [("prefill", [t], [0]) for t in prefill]
    before, rows = helper_threads.spin_us(), []
    try:
        for kind, q_lens, starts in cases:
            batch = build_batch(runner, q_lens, starts, rng)
            rounds = []
            for _ in range(_ROUNDS.value):
                times = {}
                for w in windows:
                    helper_threads.set_spin_us(w)
                    times[w] = median_ms(functools.partial(runner.run_batch, batch), _ITERS.value)
                rounds.append(times)
            rows.append(dict(summarize(kind, len(q_lens), sum(q_lens), windows, rounds), dtype=dtype))
            r = rows[-1]["windows"]
            print(f"{dtype:<9} {kind:<7} seqs {len(q_lens):>3} tokens {sum(q_lens):>5}: "
                  + ", ".join(f"{w} us {r[str(w)]['step_ms']:.1f} ms"
                              + (f" ({r[str(w)]['speedup']:.2f}x)" if "speedup" in r[str(w)] else "")
                              for w in windows), flush=True)
    finally:
        helper_threads.set_spin_us(before)
    del llm, runner
    return rows


def main(argv):
    del argv
    import os

    import numpy as np

    from cpu_kernels import build
    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    if not build.available():
        raise app.UsageError("the native CPU kernels are not available here (see the warning above)")
    windows = [int(w) for w in _SPIN_US.value]
    if len(windows) < 2 or min(windows) < 0:
        raise app.UsageError(f"--spin_us takes two or more windows >= 0, got {windows}")
    enable_compilation_cache()
    prefill = [int(t) for t in _PREFILL_TOKENS.value if t]
    model = load_for_benchmark(_MODEL.value, max([_CONTEXT_LEN.value] + prefill))
    rng = np.random.default_rng(0)
    steps = []
    for dtype in _DTYPES.value:
        steps += measure_dtype(model, dtype, windows, rng)
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    figures = {"model": model.source, "baseline_spin_us": windows[0], "steps": steps,
               "cpus": len(os.sched_getaffinity(0)), "load_average_end": os.getloadavg()}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, seed=0, figures=figures))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
