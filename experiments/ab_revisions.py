"""Offline output tok/s of two git revisions of paged_jax on one trace, A B A B in one sitting.

    python -m experiments.ab_revisions --a=4e69bf6 --b=HEAD            # the peer_vllm record's trace
    python -m experiments.ab_revisions --a=HEAD --b=HEAD --b_engine=async_scheduling=true
    python -m experiments.ab_revisions --model=tiny_llama --num_requests=4 --max_output_tokens=8 \
        --max_model_len=128 --max_num_seqs=4 --max_num_batched_tokens=64 --kv_cache_gib=0.01 --output=  # dry run

Why: the host under these CPUs changes from session to session and its speed drifts by tens
of percent within one, so "no slower than before" is only measured against the previous
code run beside the new, alternating. Each revision is checked out (`git worktree`, detached,
in a temporary directory; the working tree's uncommitted changes are not in it: commit first)
and every run is a fresh process started in it, which builds `LLM(...)` with the settings
below (those of the `peer_vllm` record's paged_jax side by default: SmolLM2-135M in float32,
64 ShareGPT-like requests capped at 120 output tokens, 64 sequences and 1024 tokens a step,
2 GiB of KV) plus the side's own --a_engine / --b_engine EngineConfig settings, and serves
the trace once, greedy; the engine's start-up is not timed. The record holds each run's
output tok/s, each side's best (other work on the machine only slows a run down), B over A,
and whether the two sides' outputs were equal token for token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

_A = flags.DEFINE_string("a", "HEAD~1", "Revision A (any git revision).")
_B = flags.DEFINE_string("b", "HEAD", "Revision B.")
_A_ENGINE = flags.DEFINE_list("a_engine", [], "Side A's extra EngineConfig settings, name=value (JSON values).")
_B_ENGINE = flags.DEFINE_list("b_engine", [], "Side B's extra EngineConfig settings, name=value (JSON values).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "A B rounds.")
_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model: a registered name, or a tiny_* preset (random weights).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "ShareGPT-like requests, all at t=0.")
_MAX_OUTPUT = flags.DEFINE_integer("max_output_tokens", 120, "Cap on each request's output tokens (0: none).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 2048, "EngineConfig.max_model_len (and the trace's cap).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "EngineConfig.max_num_seqs.")
_MAX_BATCHED = flags.DEFINE_integer("max_num_batched_tokens", 1024, "EngineConfig.max_num_batched_tokens.")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 2.0, "KV budget, GiB.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' dtype.")
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_NOTE = flags.DEFINE_string("note", "", "Recorded as is: e.g. what else ran on the machine.")
_OUTPUT = flags.DEFINE_string("output", "ab_revisions", "Result name: experiments/results/<output>.json, or a "
                                                        "path ending in .json; empty: print the figures only.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a run does, in the revision's own checkout: only APIs both sides have (LLM, load_model,
# the trace generator), so any two revisions since the trace generator existed compare.
_CHILD = r"""
import dataclasses, hashlib, json, sys, time
spec = json.loads(sys.argv[1])
from experiments.bench_models import load_for_benchmark
from experiments.benchmarks.workloads import make_trace
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.entrypoints.llm import LLM
from paged_jax.worker.compilation_cache import enable_compilation_cache
enable_compilation_cache()
loaded = load_for_benchmark(spec["model"], spec["max_model_len"])
if spec["dtype"] != "float32":
    from paged_jax.loading import load_model
    loaded = load_model(spec["model"], dtype=spec["dtype"])
trace = make_trace("sharegpt", spec["num_requests"], seed=spec["seed"], scale=1.0,
                   max_model_len=spec["max_model_len"], vocab_size=loaded.config.vocab_size)
if spec["max_output_tokens"]:
    trace = [dataclasses.replace(r, max_tokens=min(r.max_tokens, spec["max_output_tokens"])) for r in trace]
llm = LLM(loaded, **spec["engine"])
prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in trace]
params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in trace]
start = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
tokens = [list(o.outputs[0].token_ids) for o in outputs]
stats = llm.stats()
print("AB_RESULT " + json.dumps({
    "wall_s": round(seconds, 3), "output_tokens": sum(map(len, tokens)),
    "output_tokens_per_s": round(sum(map(len, tokens)) / seconds, 2),
    "outputs_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
    "num_steps": stats["num_steps"], "num_compilations_after_warm_up": stats["num_compilations_after_warm_up"],
    "source": loaded.source}))
"""


def _settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise app.UsageError(f"engine settings are name=value, got {pair!r}")
        out[name] = json.loads(value)
    return out


def _checkout(revision: str, parent: str) -> tuple[str, str]:
    """(full commit, a detached worktree of it under `parent`)."""
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", revision], check=True, capture_output=True,
                            text=True).stdout.strip()
    path = os.path.join(parent, commit[:12])
    if not os.path.exists(path):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, commit], check=True,
                       capture_output=True)
    return commit, path


def _run(path: str, spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], cwd=path, env=env, capture_output=True,
                          text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("AB_RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the run in {path} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("AB_RESULT "))


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result

    base = {"max_model_len": _MAX_MODEL_LEN.value, "max_num_seqs": _MAX_NUM_SEQS.value,
            "max_num_batched_tokens": _MAX_BATCHED.value, "kv_cache_memory_bytes": int(_KV_GIB.value * 2**30),
            "dtype": _DTYPE.value, "seed": _SEED.value}
    common = {"model": _MODEL.value, "num_requests": _NUM_REQUESTS.value, "max_output_tokens": _MAX_OUTPUT.value,
              "max_model_len": _MAX_MODEL_LEN.value, "dtype": _DTYPE.value, "seed": _SEED.value}
    sides = {"a": (_A.value, _settings(_A_ENGINE.value)), "b": (_B.value, _settings(_B_ENGINE.value))}
    runs, commits = [], {}
    with tempfile.TemporaryDirectory(prefix="ab_revisions_") as parent:
        paths = {}
        try:
            for side, (revision, _) in sides.items():
                commits[side], paths[side] = _checkout(revision, parent)
            for round_ in range(1, _ROUNDS.value + 1):
                for side, (revision, engine) in sides.items():
                    spec = {**common, "engine": {**base, **engine}}
                    run = {"side": side, "round": round_, **_run(paths[side], spec)}
                    runs.append(run)
                    print(f"round {round_} {side} ({revision}, {engine or 'defaults'}): {run['output_tokens_per_s']} "
                          f"output tok/s ({run['wall_s']} s)", flush=True)
        finally:
            for path in paths.values():
                subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", path], capture_output=True)
    best = {side: max(r["output_tokens_per_s"] for r in runs if r["side"] == side) for side in sides}
    figures = {"model": runs[0]["source"], "revisions": {s: {"revision": sides[s][0], "commit": commits[s],
                                                              "engine": sides[s][1]} for s in sides},
               "engine_settings": base, "num_requests": _NUM_REQUESTS.value,
               "max_output_tokens": _MAX_OUTPUT.value, "note": _NOTE.value, "runs": runs,
               "best_output_tokens_per_s": best, "b_over_a": round(best["b"] / best["a"], 3),
               "outputs_equal": len({r["outputs_sha256"] for r in runs}) == 1,
               "load_average_end": os.getloadavg()}
    print(f"best: A {best['a']} / B {best['b']} output tok/s (B/A {figures['b_over_a']}); "
          f"outputs equal: {figures['outputs_equal']}")
    if _OUTPUT.value:
        flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
        where = {}
        if _OUTPUT.value.endswith(".json"):  # a path (tests): its folder, its name
            where = {"results_dir": os.path.dirname(os.path.abspath(_OUTPUT.value))}
        name = os.path.basename(_OUTPUT.value).removesuffix(".json")
        print("wrote", write_result(name, flags=flag_values, figures=figures, seed=_SEED.value, **where))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
