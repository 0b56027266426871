"""KV memory saved by block sharing: parallel sampling and beam search on Alpaca-like lengths.

    python -m experiments.sharing_savings                     # n = 2, 4, 6 and beam width 2, 4, 6
    python -m experiments.sharing_savings --num_requests=2 --widths=2

Why: paged blocks let the n samples of a request share its prompt's blocks, and beams
share every block of their common history (copy-on-write splits only the last partly
full block). The paper (Fig. 15/16, OPT-13B, Alpaca, block 16) reports the saving as
(blocks needed without sharing - blocks used) / blocks needed without sharing:
6.1-9.8% for parallel sampling, 37.6-55.2% for beam search. The engine's
stats()["sharing_savings"] is that ratio summed over steps (1 - sum used / sum needed).

Each setting runs on a fresh LLM (one loaded model, same KV budget, same trace), all
requests at t = 0, prefix caching off by default so that only fork sharing counts.
Sampling: SamplingParams(n, --temperature, per-request seed, max_tokens = the trace's
output length, ignore_eos). Beam search: BeamSearchParams(width, max_tokens = the same
length, ignore_eos). Prompts are the trace's random token ids; a real model is still
needed for beam search, since its beams agree on long prefixes only when the model is
confident (a random model's beams diverge at once).
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags
from tqdm.auto import tqdm

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source).")
_MODES = flags.DEFINE_list("modes", ["sampling", "beam"], "Which sharing kinds to run: sampling, beam.")
_WIDTHS = flags.DEFINE_list("widths", ["2", "4", "6"], "Parallel samples n / beam widths to run.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 16, "Alpaca-like requests per setting (all at t=0).")
_SCALE = flags.DEFINE_float("scale", 1.0, "Length scale of the Alpaca-like trace (1.0: mean 19 / 58).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature of parallel sampling.")
_IGNORE_EOS = flags.DEFINE_boolean("ignore_eos", True, "Run every completion / beam to the trace's length.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_PREFIX_CACHING = flags.DEFINE_boolean("enable_prefix_caching", False, "Prefix caching (off: fork sharing only).")
_KV_BYTES = flags.DEFINE_integer("kv_cache_memory_bytes", 512 * 2**20, "KV cache budget, the same for all settings.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 1024, "Engine max_model_len (and the trace's cap).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 32, "Sequences per step.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 256, "Tokens per step.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace and sampling seed.")


def _run(llm, trace, make_params, desc: str) -> list:
    """All requests at t = 0 through the engine; returns the finished RequestOutputs."""
    engine = llm.engine
    for i, request in enumerate(trace):
        engine.add_request(f"{desc}-{i}", list(request.prompt_token_ids), make_params(i, request))
    finished = []
    with tqdm(total=len(trace), desc=desc) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append(out)
                    bar.update(1)
    return finished


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    from experiments.benchmarks.workloads import make_trace
    from paged_jax.core.beam_search import BeamSearchParams
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.loading import load_model
    from paged_jax.core.sampling_params import SamplingParams
    if set(_MODES.value) - {"sampling", "beam"}:
        raise app.UsageError(f"--modes must be among sampling, beam; got {_MODES.value}")
    widths = [int(w) for w in _WIDTHS.value]
    enable_compilation_cache()
    model = load_model(_MODEL.value, dtype="float32")
    trace = make_trace("alpaca", _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value,
                       max_model_len=_MAX_MODEL_LEN.value, vocab_size=model.config.vocab_size)
    prompt_lens = [len(r.prompt_token_ids) for r in trace]
    output_lens = [r.max_tokens for r in trace]
    print(f"{len(trace)} Alpaca-like requests: mean prompt {statistics.mean(prompt_lens):.1f}, "
          f"mean output {statistics.mean(output_lens):.1f} tokens; load average {os.getloadavg()}")
    settings = {"block_size": _BLOCK_SIZE.value, "kv_cache_memory_bytes": _KV_BYTES.value,
                "max_model_len": _MAX_MODEL_LEN.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                "max_num_batched_tokens": _MAX_BATCHED.value, "enable_prefix_caching": _PREFIX_CACHING.value}
    rows = []
    for mode in _MODES.value:
        for width in widths:
            if mode == "sampling":
                def make_params(i, r, n=width):
                    return SamplingParams(n=n, temperature=_TEMPERATURE.value, seed=_SEED.value * 100_003 + i,
                                          max_tokens=r.max_tokens, ignore_eos=_IGNORE_EOS.value)
            else:
                def make_params(i, r, w=width):
                    return BeamSearchParams(beam_width=w, max_tokens=r.max_tokens, ignore_eos=_IGNORE_EOS.value)
            llm = LLM(model, paper_metrics=True, **settings)  # fresh stats and cache per setting; compiled programs are cached
            start = time.perf_counter()
            outputs = _run(llm, trace, make_params, f"{mode} {width}")
            seconds = time.perf_counter() - start
            stats = llm.stats()
            output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            rows.append({"mode": mode, "width": width, "sharing_savings": round(stats["sharing_savings"], 4),
                         "mean_blocks_used": round(stats["mean_blocks_used"], 2),
                         "mean_blocks_without_sharing": round(stats["mean_blocks_without_sharing"], 2),
                         "num_requests": len(outputs), "output_tokens": output_tokens,
                         "wall_seconds": round(seconds, 2), "output_tokens_per_s": round(output_tokens / seconds, 2),
                         "requests_per_s": round(len(outputs) / seconds, 4), "num_steps": stats["num_steps"],
                         "num_preemptions": stats["num_preemptions"],
                         "mean_batched_seqs": round(stats["mean_batched_seqs"], 2),
                         "kv_utilization": round(stats["kv_utilization"] or 0.0, 4),
                         "num_blocks_total": stats["num_blocks_total"],
                         "num_compilations_after_warm_up": stats["num_compilations_after_warm_up"]})
            del llm

    figures = {"model": model.source, "dtype": "float32", "workload": "alpaca", "engine_settings": settings,
               "mean_prompt_tokens": statistics.mean(prompt_lens), "mean_output_tokens": statistics.mean(output_lens),
               "paper_savings": {"sampling": [0.061, 0.098], "beam": [0.376, 0.552]}, "settings": rows,
               "load_average_end": os.getloadavg()}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    path = write_result("sharing_savings", flags=flag_values, figures=figures, seed=_SEED.value)
    print("wrote", path)
    print(f"\n{'mode':>8} {'width':>5} {'savings':>8} {'used':>8} {'no-share':>8} {'reqs':>4} {'out tok':>7} "
          f"{'tok/s':>7} {'wall s':>7} {'preempt':>7}")
    for r in rows:
        print(f"{r['mode']:>8} {r['width']:>5} {r['sharing_savings']:>8.4f} {r['mean_blocks_used']:>8.2f} "
              f"{r['mean_blocks_without_sharing']:>8.2f} {r['num_requests']:>4} {r['output_tokens']:>7} "
              f"{r['output_tokens_per_s']:>7.1f} {r['wall_seconds']:>7.1f} {r['num_preemptions']:>7}")
    print("paper (OPT-13B, Alpaca): sampling 6.1-9.8%, beam search 37.6-55.2%")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
