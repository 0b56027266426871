"""Engine figures from one run: KV utilization on a ShareGPT-like trace, and host overhead.

    python -m experiments.engine_metrics                     # both, defaults below
    python -m experiments.engine_metrics --measure=utilization --num_requests=64

utilization: --num_requests ShareGPT-like requests (all at t=0, EOS ignored so output
  lengths are the trace's) through the paged engine at --block_size; reports the mean
  over steps of tokens held / slots allocated. It depends only on lengths and block
  size, so by default a random-weight model (--utilization_preset) runs it fast.
host_overhead: --host_seqs requests decoding together on --model; reports scheduler +
  block manager + batch preparation + output processing time per step, against the
  jitted step's time, over the steps that ran exactly --host_seqs decodes.
attention_backends: the same 32 requests (prompts 50..400 tokens, --backend_new_tokens new
  tokens each, max_model_len 1024) on --model with each of --backends; reports end-to-end
  output tokens/s of each (what `attention_backend="auto"` is chosen by).
"""

from __future__ import annotations

import statistics

from absl import app, flags

_MEASURE = flags.DEFINE_enum("measure", "both", ["both", "utilization", "host_overhead", "attention_backends"],
                             "What to measure (both = utilization and host_overhead).")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model for the host-overhead run (any load_model source).")
_UTIL_PRESET = flags.DEFINE_string("utilization_preset", "tiny_llama",
                                   "configs preset run with random weights for the utilization run; "
                                   "empty: use --model.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests in the utilization trace.")
_SCALE = flags.DEFINE_float("scale", 1.0, "Length scale of the ShareGPT-like trace.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "max_model_len of the utilization run.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step.")
_HOST_SEQS = flags.DEFINE_integer("host_seqs", 32, "Concurrent decoding sequences in the host-overhead run.")
_HOST_TOKENS = flags.DEFINE_integer("host_output_tokens", 48, "Tokens each host-overhead request generates.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_BACKENDS = flags.DEFINE_list("backends", ["reference", "pallas", "xla"],
                              "attention_backend values the attention_backends run compares.")
_BACKEND_NEW_TOKENS = flags.DEFINE_integer("backend_new_tokens", 32,
                                           "Tokens each request of the attention_backends run generates "
                                           "(32: prefill-heavy; 128+: mostly decode steps).")
_OUTPUT = flags.DEFINE_string("output", "", "Result name (default: engine_metrics, or engine_attention_backends "
                                            "for --measure=attention_backends).")


def _engine_model(preset: str, model: str):
    """--utilization_preset with random weights (position limit lifted to --max_model_len), else --model."""
    from experiments.bench_models import RANDOM_PREFIX, load_for_benchmark
    return load_for_benchmark(f"{RANDOM_PREFIX}{preset}" if preset else model, _MAX_MODEL_LEN.value)


def _utilization() -> dict:
    from experiments.benchmarks.workloads import make_trace, trace_means
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    model = _engine_model(_UTIL_PRESET.value, _MODEL.value)
    trace = make_trace("sharegpt", _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value,
                       max_model_len=_MAX_MODEL_LEN.value, vocab_size=model.config.vocab_size)
    llm = LLM(model, block_size=_BLOCK_SIZE.value, max_model_len=_MAX_MODEL_LEN.value,
              max_num_seqs=_MAX_NUM_SEQS.value, max_num_batched_tokens=256, paper_metrics=True)  # kv_utilization
    llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in trace],
                 [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in trace])
    stats = llm.stats()
    means = trace_means(trace)
    print(f"KV utilization {stats['kv_utilization']:.4f} over {stats['num_steps']} steps "
          f"(mean prompt {means['mean_prompt_tokens']:.0f}, mean output {means['mean_output_tokens']:.0f})")
    return {"model": model.source, "kv_utilization": round(stats["kv_utilization"], 4),
            "num_steps": stats["num_steps"], "num_preemptions": stats["num_preemptions"],
            **means,
            "mean_batched_seqs": round(stats["mean_batched_seqs"], 2),
            "num_compilations_after_warm_up": stats["num_compilations_after_warm_up"]}


def _host_overhead() -> dict:
    import numpy as np

    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    model = _engine_model("", _MODEL.value)
    n = _HOST_SEQS.value
    llm = LLM(model, block_size=_BLOCK_SIZE.value, max_model_len=256, max_num_seqs=n, max_num_batched_tokens=256)
    rng = np.random.default_rng(_SEED.value)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, model.config.vocab_size, rng.integers(16, 48))]}
               for _ in range(n)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=_HOST_TOKENS.value, ignore_eos=True))
    decode = [(h, d) for seqs, toks, h, d in llm.engine.stats_tracker.step_log if seqs == n and toks == n]
    host = statistics.mean(h for h, _ in decode)
    device = statistics.mean(d for _, d in decode)
    print(f"{len(decode)} decode steps at {n} sequences: host {host * 1e3:.2f} ms, device {device * 1e3:.1f} ms "
          f"per step; host share {host / (host + device):.3f}")
    return {"model": model.source, "num_seqs": n, "num_decode_steps": len(decode),
            "host_ms_per_step": round(host * 1e3, 3), "device_ms_per_step": round(device * 1e3, 2),
            "host_fraction_of_step": round(host / (host + device), 4),
            "output_tokens_per_s_in_decode": round(n / (host + device), 1)}


def _attention_backends() -> dict:
    import time

    import numpy as np

    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    model = _engine_model("", _MODEL.value)
    rng = np.random.default_rng(_SEED.value)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, model.config.vocab_size, rng.integers(50, 400))]}
               for _ in range(32)]
    figures, new = {}, _BACKEND_NEW_TOKENS.value
    for backend in _BACKENDS.value:
        llm = LLM(model, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=256, attention_backend=backend)
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
        figures[backend] = {"seconds": round(seconds, 2), "output_tokens_per_s": round(32 * new / seconds, 2),
                            "device_ms_per_step": round(stats["device_seconds_per_step"] * 1e3, 1),
                            "num_steps": stats["num_steps"]}
        print(f"{backend:>9}: {seconds:.1f} s, {32 * new / seconds:.1f} output tok/s", flush=True)
    for backend in ("pallas", "xla"):
        if "reference" in figures and backend in figures:
            figures[f"{backend}_speedup"] = round(figures["reference"]["seconds"] / figures[backend]["seconds"], 2)
    figures["model"] = model.source
    return figures


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    figures = {}
    if _MEASURE.value in ("both", "utilization"):
        figures["utilization"] = _utilization()
    if _MEASURE.value in ("both", "host_overhead"):
        figures["host_overhead"] = _host_overhead()
    if _MEASURE.value == "attention_backends":
        figures["attention_backends"] = _attention_backends()
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    name = _OUTPUT.value or ("engine_attention_backends" if _MEASURE.value == "attention_backends"
                             else "engine_metrics")
    print("wrote", write_result(name, flags=flag_values, figures=figures, seed=_SEED.value))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
