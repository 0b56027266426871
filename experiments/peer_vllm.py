"""vLLM's own CPU backend against our engine: the same trace, token ids, weights and cores.

    bash experiments/setup_vllm_cpu.sh                     # once: vLLM's venv + the HF model
    python -m experiments.peer_vllm                        # 64 ShareGPT-like requests, scale 1.0
    python -m experiments.peer_vllm --dtype=bfloat16 --output=peer_vllm_bf16

Why: "faster than vLLM on these CPUs" has to be measured against vLLM itself, not assumed
from the paper's GPU figures or from transformers (experiments/peer_hf.py). Both engines get
the same requests (experiments/benchmarks/workloads.py; greedy, EOS ignored, all at t=0) as
the same token ids (vLLM: TokensPrompt), the same weights (the project's GGUF, dequantized to
a Hugging Face directory by the setup script), dtype, max_num_seqs, max_model_len and KV
budget, on all of this machine's cores. Runs alternate A B A B (--rounds), so drift of a
shared machine hits both; vLLM runs in its own venv as a subprocess
(experiments/benchmarks/vllm_worker.py), a fresh one per run, its load and warm-up timed
apart; our engine is built once (its warm-up compiles every step shape), its prefix cache
emptied before each round (the trace repeats, vLLM's fresh process has an empty one).
vLLM modes (--vllm_modes):
  both_cores: VLLM_CPU_OMP_THREADS_BIND=<every allowed core>, VLLM_CPU_NUM_OF_RESERVED_CPU=0:
              its OpenMP model threads on all cores, like ours.
  default:    vLLM's own binding, which reserves a core for its scheduler process: what a user
              who sets nothing gets.
Outputs: every run against the first vLLM run, token for token; in float32 a difference is
accepted only at a near-tie checked on transformers' float32 logits (tests/helpers/
greedy_check.py), mismatches counted, never fatal. In bfloat16 differences are counted unchecked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time

from absl import app, flags

from experiments.benchmarks import vllm_worker
from experiments.benchmarks.vllm_worker import (compare_outputs, sparse_logits, summarize, throughput,
                                                 tie_queries, wrong_lengths)

_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Registered model name: paged_jax loads its GGUF.")
_HF_MODEL_DIR = flags.DEFINE_string("hf_model_dir",
                                    os.environ.get("HF_MODEL_DIR", os.path.join(_CACHE, "smollm2-135m-hf")),
                                    "The same weights as a Hugging Face directory for vLLM (setup_vllm_cpu.sh "
                                    "writes it; default $HF_MODEL_DIR or ~/.cache/paged_jax/smollm2-135m-hf).")
_VLLM_VENV = flags.DEFINE_string("vllm_venv", os.environ.get("VLLM_VENV", os.path.join(_CACHE, "vllm-venv")),
                                 "vLLM's venv (default $VLLM_VENV or ~/.cache/paged_jax/vllm-venv).")
_WORKLOAD = flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"],
                              "experiments/benchmarks/workloads.py trace.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests in the trace (all arrive at t=0).")
_SCALE = flags.DEFINE_float("scale", 1.0, "Length scale of the trace (1.0 ShareGPT: prompts ~160, outputs ~340).")
_MAX_OUTPUT = flags.DEFINE_integer("max_output_tokens", 0, "Cap on each request's output tokens (0: the trace's "
                                   "own; 120 at scale 1.0 gives prompts ~160, outputs ~110: a shorter run).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "Prompt + output cap (trace and both engines).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "Sequences per step, both engines.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 2048,
                                    "Our engine's tokens per step (vLLM: its default, 4096 on CPU). 2048: our "
                                    "fastest on this trace of 256 / 1024 / 2048 in bfloat16, and level with 1024 "
                                    "in float32 (python -m experiments.trace_step_breakdown [--dtype=float32]).")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 2.0, "KV cache budget of each engine, GiB (2: the default trace "
                                                  "fits without preemption in float32).")
_ATTENTION = flags.DEFINE_string("attention_backend", "auto", "Our engine's attention (EngineConfig.attention_backend; "
                                                           "auto: the native C++ kernel on CPU).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Both engines' dtype (ours in bfloat16: bf16 weights and KV cache, f32 accumulation).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "A B A B rounds: each round every vLLM mode, then our engine.")
_VLLM_MODES = flags.DEFINE_list("vllm_modes", ["both_cores", "default"], "vLLM thread settings (see the docstring).")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed (and both engines' seed).")
_OUTPUT = flags.DEFINE_string("output", "peer_vllm", "Result name: experiments/results/<output>.json.")

MODES = ("both_cores", "default")
_BIND_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def vllm_env(mode: str) -> dict:
    """The worker's environment: ours, less our venv and any binding we inherited, plus the mode's."""
    env = {k: v for k, v in os.environ.items() if k not in _BIND_VARS + ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.path.join(_VLLM_VENV.value, "bin") + os.pathsep + env.get("PATH", "")
    if mode == "both_cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def call_worker(command: str, spec: dict, env: dict | None = None) -> dict:
    """Run vllm_worker.py `command` in vLLM's venv on spec; its output and progress pass through."""
    python = os.path.join(_VLLM_VENV.value, "bin", "python")
    if not os.path.exists(python):
        raise FileNotFoundError(f"{python} missing: run `bash experiments/setup_vllm_cpu.sh` first")
    with tempfile.TemporaryDirectory(prefix="peer_vllm_") as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(spec, f)
        run = subprocess.run([python, vllm_worker.__file__, command, src, dst], env=env or vllm_env("default"),
                             cwd=tmp, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"vllm_worker.py {command} exited {run.returncode} (its output is above)")
        with open(dst) as f:
            return json.load(f)


def run_vllm(requests, mode: str, kv_bytes: int) -> tuple[list, dict, dict]:
    """(outputs, figures, worker details) of one fresh vLLM process on the trace."""
    spec = {"model_dir": _HF_MODEL_DIR.value, "dtype": _DTYPE.value, "max_num_seqs": _MAX_NUM_SEQS.value,
            "max_model_len": _MAX_MODEL_LEN.value, "kv_cache_memory_bytes": kv_bytes, "seed": _SEED.value,
            "warmup": True, "prompts": [list(r.prompt_token_ids) for r in requests],
            "max_tokens": [r.max_tokens for r in requests]}
    env = vllm_env(mode)
    out = call_worker("generate", spec, env)
    figures = throughput(len(requests), sum(r.max_tokens for r in requests), out["wall_s"])
    figures.update(load_s=round(out["load_s"], 1), warmup_s=round(out["warmup_s"], 1),
                   generated_tokens=sum(map(len, out["outputs"])),
                   wrong_length_requests=wrong_lengths(out["outputs"], [r.max_tokens for r in requests]))
    details = {"versions": out["versions"], "config": out["config"],
               "env": {k: env[k] for k in _BIND_VARS if k in env}}
    return out["outputs"], figures, details


def run_paged_jax(llm, requests) -> tuple[list, dict]:
    """(outputs, figures) of one round on our already built engine, prefix cache emptied first."""
    from paged_jax.core.sampling_params import SamplingParams
    llm.reset_prefix_cache()
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                        [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests],
                        use_tqdm=True)
    figures = throughput(len(requests), sum(r.max_tokens for r in requests), time.perf_counter() - start)
    after = llm.stats()
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    figures.update(generated_tokens=sum(map(len, outputs)),
                   wrong_length_requests=wrong_lengths(outputs, [r.max_tokens for r in requests]),
                   **{k: after[k] - before[k] for k in ("num_preemptions", "num_steps")},
                   num_compilations_after_warm_up=after["num_compilations_after_warm_up"])
    return outputs, figures


def main(argv):
    del argv
    from experiments.benchmarks.workloads import make_trace
    from experiments.reporting.results_io import write_result
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.loading import load_model
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    unknown = set(_VLLM_MODES.value) - set(MODES)
    if unknown or not _VLLM_MODES.value:
        raise app.UsageError(f"--vllm_modes: one or more of {MODES}, got {_VLLM_MODES.value}")
    if not os.path.exists(os.path.join(_HF_MODEL_DIR.value, "config.json")):
        raise app.UsageError(f"{_HF_MODEL_DIR.value} has no model: run `bash experiments/setup_vllm_cpu.sh` first")
    enable_compilation_cache()
    loaded = load_model(_MODEL.value, dtype=_DTYPE.value)
    requests = make_trace(_WORKLOAD.value, _NUM_REQUESTS.value, seed=_SEED.value, scale=_SCALE.value,
                          max_model_len=_MAX_MODEL_LEN.value, vocab_size=loaded.config.vocab_size)
    if _MAX_OUTPUT.value:
        requests = [dataclasses.replace(r, max_tokens=min(r.max_tokens, _MAX_OUTPUT.value)) for r in requests]
    prompts = [list(r.prompt_token_ids) for r in requests]
    kv_bytes = int(_KV_GIB.value * 2**30)
    figures = {"model": loaded.source, "hf_model_dir": _HF_MODEL_DIR.value, "dtype": _DTYPE.value,
               "mean_prompt_tokens": round(statistics.mean(map(len, prompts)), 1),
               "mean_output_tokens": round(statistics.mean(r.max_tokens for r in requests), 1),
               "useful_output_tokens": sum(r.max_tokens for r in requests), "cpu_cores": len(os.sched_getaffinity(0))}
    print(f"{len(requests)} {_WORKLOAD.value} requests: mean prompt {figures['mean_prompt_tokens']}, mean output "
          f"{figures['mean_output_tokens']} tokens; {_ROUNDS.value} rounds of vllm {_VLLM_MODES.value} then paged_jax",
          flush=True)
    start = time.perf_counter()
    llm = LLM(loaded, max_model_len=_MAX_MODEL_LEN.value, max_num_seqs=_MAX_NUM_SEQS.value,
              max_num_batched_tokens=_MAX_BATCHED.value, kv_cache_memory_bytes=kv_bytes, dtype=_DTYPE.value,
              seed=_SEED.value, attention_backend=_ATTENTION.value)
    figures["paged_jax_setup_s"] = round(time.perf_counter() - start, 1)
    figures["paged_jax_attention_backend"] = llm.engine.config.attention_backend  # "auto" resolved
    runs, outputs, details = [], {}, {}
    total = _ROUNDS.value * (len(_VLLM_MODES.value) + 1)
    for round_ in range(1, _ROUNDS.value + 1):
        for system, mode in [("vllm", m) for m in _VLLM_MODES.value] + [("paged_jax", "paged_jax")]:
            label = f"{system if system == 'paged_jax' else 'vllm ' + mode} round {round_}"
            print(f"[{len(runs) + 1}/{total}] {label} ...", flush=True)
            if system == "vllm":
                outputs[label], run, details[mode] = run_vllm(requests, mode, kv_bytes)
            else:
                outputs[label], run = run_paged_jax(llm, requests)
            runs.append({"system": system, "mode": mode, "round": round_, **run})
            print(f"[{len(runs)}/{total}] {label}: {run['output_tokens_per_s']} output tok/s "
                  f"({run['wall_s']} s)", flush=True)
    figures["runs"] = runs
    figures["vllm"] = details
    figures["versions"] = next(iter(details.values()))["versions"]
    figures["summary"] = summarize(runs, _VLLM_MODES.value)
    # every run against the first vLLM run, token for token
    reference_label = next(iter(outputs))
    reference = outputs[reference_label]
    others = {k: v for k, v in outputs.items() if k != reference_label}
    logits = None
    if _DTYPE.value == "float32":
        queries = tie_queries(prompts, reference, others.values())
        if queries:
            print(f"near-tie check: {len(queries)} reference logits from transformers (float32) ...", flush=True)
            answer = call_worker("logits", {"model_dir": _HF_MODEL_DIR.value, "queries": queries})
            logits = sparse_logits(queries, answer["logits"], loaded.config.vocab_size)
        else:
            logits = sparse_logits([], [], loaded.config.vocab_size)  # nothing differs: nothing to look up
    figures["greedy_check"] = {"reference": reference_label, "near_ties_checked": logits is not None,
                               "runs": {k: compare_outputs(prompts, reference, v, logits) for k, v in others.items()}}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures=figures, seed=_SEED.value))
    print_report(figures)


def print_report(figures: dict) -> None:
    print(f"\n{'system':<20}{'round':>6}{'wall s':>9}{'out tok/s':>11}{'load s':>8}")
    for r in figures["runs"]:
        name = "paged_jax" if r["system"] == "paged_jax" else f"vllm {r['mode']}"
        print(f"{name:<20}{r['round']:>6}{r['wall_s']:>9}{r['output_tokens_per_s']:>11}{r.get('load_s', ''):>8}")
        if r["wrong_length_requests"]:
            print(f"  {name} round {r['round']}: outputs not max_tokens long: {r['wrong_length_requests']}")
    for mode, s in figures["summary"].items():
        if isinstance(s, dict):
            print(f"paged_jax / vllm {mode}: {s['ratio']}x (per round {s['ratio_per_round']})")
    check = figures["greedy_check"]
    for label, c in check["runs"].items():
        print(f"{label} vs {check['reference']}: {c['equal']} equal, {c['near_tie']} near-tie, "
              f"{c['mismatch']} mismatched {c['mismatched_requests']}, {c['unchecked']} differ unchecked")
    print("versions:", figures["versions"])


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
