"""Fit the simulator's step-time model to the real engine's measured steps.

    python -m experiments.calibrate_step_time                 # SmolLM2-135M, ~6 minutes on 2 shared CPU cores
    python -m experiments.calibrate_step_time --model=tiny_llama --fit_requests=16 --holdout_requests=8

Why: experiments/simulate.py replaces the model by a step-time model (see
experiments/simulator/step_time_model.py), so its latencies and throughputs are only as good as
that model. Here the real engine serves two seeded traces, all requests at t = 0 (a
ramp of prefill-heavy steps, full decode batches, then a tail of shrinking batches):
the fit trace (--fit_workload) and a held-out trace of another workload
(--holdout_workload). Each step's wall time (the whole `LLMEngine.step`: scheduling,
batch preparation, the jitted step, output processing, i.e. what the simulator's clock
advances by) is recorded with the step's features (tokens, sequences, context tokens);
the model is fitted on the fit trace and its error reported on the held-out one, twice:
with the raw counts and with tokens and sequences padded to the engine's buckets (what
the runner really runs; that one is the model the simulator uses). Every measured step
is kept in the record, so other models can be fitted from it without rerunning. Times
on this shared 2-core machine drift: the load average is recorded with the fit.

Writes experiments/results/step_time_model.json (--output); the simulator reads the
fitted coefficients from figures.model.
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source), or a tiny_* configs preset "
                                                      "(e.g. tiny_llama) with random weights: fast, not for claims.")
_FIT_WORKLOAD = flags.DEFINE_enum("fit_workload", "sharegpt", ["sharegpt", "alpaca"], "Workload of the fit trace.")
_FIT_REQUESTS = flags.DEFINE_integer("fit_requests", 48, "Requests in the fit trace (all at t = 0).")
_HOLDOUT_WORKLOAD = flags.DEFINE_enum("holdout_workload", "alpaca", ["sharegpt", "alpaca"],
                                      "Workload of the held-out trace the fit is judged on.")
_HOLDOUT_REQUESTS = flags.DEFINE_integer("holdout_requests", 64, "Requests in the held-out trace.")
_SCALE = flags.DEFINE_float("scale", 0.25, "Length scale of the fit trace (1.0: the data set's means).")
_HOLDOUT_SCALE = flags.DEFINE_float("holdout_scale", 1.0, "Length scale of the held-out trace.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "Engine max_model_len (and the traces' cap).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step (the simulator's default too).")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step (the simulator's default too).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_SKIP_STEPS = flags.DEFINE_integer("skip_steps", 3, "First steps of each trace left out (first-call effects).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the fit trace (the held-out trace uses seed + 1).")
_OUTPUT = flags.DEFINE_string("output", "step_time_model", "Result name: experiments/results/<output>.json.")


def measure_steps(engine, trace) -> list[tuple]:
    """Serve `trace` (all at once) on `engine`; per step: (num_tokens, num_seqs,
    context_tokens, padded num_tokens, padded num_seqs, wall seconds)."""
    from experiments.simulator.step_time_model import step_features
    from paged_jax.core.sampling_params import SamplingParams
    for i, request in enumerate(trace):
        engine.add_request(f"c{id(trace)}-{i}", {"prompt_token_ids": list(request.prompt_token_ids)},
                           SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True))
    outputs, schedule = [], engine.scheduler.schedule

    def recording():
        outputs.append(schedule())
        return outputs[-1]
    engine.scheduler.schedule = recording
    steps = []
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            padded_tokens, padded_seqs, _ = step_features(outputs[-1], engine.config.seq_buckets,
                                                          engine.config.token_buckets)
            steps.append((*step_features(outputs[-1]), padded_tokens, padded_seqs, round(seconds, 6)))
    finally:
        engine.scheduler.schedule = schedule
    return steps[_SKIP_STEPS.value:]


def features(steps, bucketed: bool):
    """(f[n, 3] features in FEATURES order, f[n] seconds) of measured steps."""
    import numpy as np
    steps = np.array(steps, np.float64)
    columns = [3, 4, 2] if bucketed else [0, 1, 2]
    return steps[:, columns], steps[:, 5]


def _summary(steps) -> dict:
    tokens, seqs, context, *_, seconds = zip(*steps)
    return {"num_steps": len(steps), "mean_step_seconds": statistics.mean(seconds),
            "num_tokens_range": [min(tokens), max(tokens)], "num_seqs_range": [min(seqs), max(seqs)],
            "context_tokens_range": [min(context), max(context)]}


def main(argv):
    del argv
    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from experiments.simulator.step_time_model import StepTimeModel, fit_error
    from experiments.benchmarks.workloads import make_trace
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.config.engine_config import EngineConfig
    enable_compilation_cache()
    wall_start, load_average_start = time.perf_counter(), os.getloadavg()
    model = load_for_benchmark(_MODEL.value, _MAX_MODEL_LEN.value)
    config = EngineConfig(block_size=_BLOCK_SIZE.value, max_model_len=_MAX_MODEL_LEN.value,
                          max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=_MAX_BATCHED.value,
                          enable_prefix_caching=False)
    engine = LLMEngine(model, config)  # compiles every bucket before anything is timed
    traces = {name: make_trace(workload, n, seed=seed, scale=scale, max_model_len=_MAX_MODEL_LEN.value,
                               vocab_size=model.config.vocab_size)
              for name, workload, n, seed, scale in (
                  ("fit", _FIT_WORKLOAD.value, _FIT_REQUESTS.value, _SEED.value, _SCALE.value),
                  ("holdout", _HOLDOUT_WORKLOAD.value, _HOLDOUT_REQUESTS.value, _SEED.value + 1, _HOLDOUT_SCALE.value))}
    measured = {}
    for name, trace in traces.items():
        measured[name] = measure_steps(engine, trace)
        print(f"{name}: {len(measured[name])} steps, mean {_summary(measured[name])['mean_step_seconds']:.3f} s")
    source = f"{model.source} on {os.uname().machine} ({os.cpu_count()} CPUs), {engine.config.attention_backend}"
    # both feature sets are fitted on the fit trace and judged on the held-out one; the
    # bucketed one is the model (the runner does pad every step to a bucket)
    fits = {}
    for bucketed in (True, False):
        model_fit = StepTimeModel.fit(*features(measured["fit"], bucketed), bucketed=bucketed, source=source)
        fits["bucketed" if bucketed else "raw_counts"] = {
            "model": model_fit.to_dict(), "fit_error": fit_error(model_fit, *features(measured["fit"], bucketed)),
            "holdout_error": fit_error(model_fit, *features(measured["holdout"], bucketed))}
    fitted = StepTimeModel.from_dict(fits["bucketed"]["model"])
    figures = {
        "model": fitted.to_dict(),
        "features": "t = intercept_s + per_token_s * num_tokens + per_seq_s * num_seqs"
                    " + per_context_token_s * context_tokens (experiments/simulator/step_time_model.py); bucketed: num_tokens"
                    " and num_seqs padded to the engine's buckets",
        "engine_settings": {"block_size": config.block_size, "max_model_len": config.max_model_len,
                            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                            "attention_backend": engine.config.attention_backend,
                            "seq_buckets": list(engine.config.seq_buckets),
                            "token_buckets": list(engine.config.token_buckets)},
        "fit": {**_summary(measured["fit"]), "workload": _FIT_WORKLOAD.value, "scale": _SCALE.value},
        "holdout": {**_summary(measured["holdout"]), "workload": _HOLDOUT_WORKLOAD.value,
                    "scale": _HOLDOUT_SCALE.value},
        "fits": fits,
        "wall_seconds": time.perf_counter() - wall_start,
        "load_average_start": load_average_start, "load_average_end": os.getloadavg(),
        # every measured step: num_tokens, num_seqs, context_tokens, padded tokens, padded seqs, seconds
        "steps": {name: [list(s) for s in steps] for name, steps in measured.items()},
    }
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    for name, entry in fits.items():
        m = entry["model"]
        print(f"{name}: t = {m['intercept_s'] * 1e3:.2f} ms + {m['per_token_s'] * 1e3:.3f} ms/token + "
              f"{m['per_seq_s'] * 1e3:.3f} ms/seq + {m['per_context_token_s'] * 1e6:.3f} us/context token")
        for which in ("fit_error", "holdout_error"):
            e = entry[which]
            print(f"  {which:>13}: {e['num_steps']} steps, relative error mean {e['mean_relative_error']:.3f}, "
                  f"p90 {e['p90_relative_error']:.3f}, max {e['max_relative_error']:.3f}, "
                  f"total {e['total_relative_error']:.3f}")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
