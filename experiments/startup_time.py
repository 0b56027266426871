"""How long `LLM("smollm2-135m")` takes to start, cold and warm, and where the time goes.

    python -m experiments.startup_time                  # SmolLM2-135M, default settings: cold, then warm
    python -m experiments.startup_time --model=tiny_llama --max_num_seqs=2 --max_num_batched_tokens=16 \
        --max_model_len=64 --output=                    # a dry run (random weights, figures meaningless)

Why: a user's first contact is the start-up. Each run is a fresh Python process that does
what a user does (import, `LLM(model)` with default settings, one greedy `generate`), with
the persistent compilation cache (`paged_jax/worker/compilation_cache.py`, enabled as the
server enables it) pointed at a temporary directory: empty for the first ("cold") run,
filled by it for the next --warm_runs ("warm") runs. The cold run also gets an empty native
kernel cache (`cpu_kernels/build.py`), so it pays the C++ build a new machine pays.

Per run the record holds the wall time of each phase, from the process's spawn:
python start-up, `import jax`, `import paged_jax` (+ LLM), model load (for GGUF: weights
and tokenizer), weight packing (the runner's serving layout and packed LM head, with the
native kernel build), the rest of the runner's and the engine's build, warm-up (per
bucket: its step and heads, read whole from the executable cache
(`paged_jax/worker/executable_cache.py`, the sibling of the compilation cache) or traced,
lowered and compiled or read from the compilation cache), the first generate; JAX's own
compile events (trace, lower, backend compile, cache reads, hits and misses) per phase; the
executable cache's hits, misses, unreadable entries and the seconds spent reading and
writing it; the process's CPU seconds (on a shared machine, wall time above CPU time is
time the process waited for a core); and what the console showed.
The phases are timed by wrapping the functions that do them (`_HOOKS`); a hook whose
function has moved records None, and the dry-run test fails until it is pointed at the
new place. Greedy outputs of every run are recorded and must be equal.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any LLM() source) or a tiny_* preset (random weights).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", None, "EngineConfig.max_num_seqs (None: the default).")
_MAX_TOKENS_PER_STEP = flags.DEFINE_integer("max_num_batched_tokens", None,
                                            "EngineConfig.max_num_batched_tokens (None: the default).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", None, "EngineConfig.max_model_len (None: the default).")
_WARM_RUNS = flags.DEFINE_integer("warm_runs", 1, "Runs after the cold one, on the cache it filled.")
_PROMPT = flags.DEFINE_string("prompt", "The capital of France is", "The first generate's prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens the first (greedy) generate asks for.")
_COLD_KERNELS = flags.DEFINE_bool("cold_kernel_cache", True, "The cold run builds the native kernels into an empty "
                                   "cache too (as on a new machine); False: every run uses the user's built kernels.")
_NOTE = flags.DEFINE_string("note", "", "Recorded as is: e.g. what else ran on the machine.")
_OUTPUT = flags.DEFINE_string("output", "startup_time", "Result name: experiments/results/<output>.json; "
                                                        "empty: print the figures only.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")  # passed to LLM() when set
_SPAWN_ENV = "PAGED_JAX_STARTUP_SPAWN_TIME"  # the parent's time.time() just before it started the child
# phase -> (module, owner attribute or "", function): each call of the function counts to the phase
_HOOKS = {
    "model_load": ("paged_jax.engine.llm_engine", "", "load_model"),
    "gguf_weights": ("paged_jax.loading.gguf_weights", "", "load_gguf"),
    "gguf_tokenizer": ("paged_jax.loading.gguf_tokenizer", "", "load_gguf_tokenizer"),
    "runner_build": ("paged_jax.worker.model_runner", "ModelRunner", "__init__"),
    "pack_unstack_layers": ("paged_jax.worker.step_model", "", "unstack_layers"),
    "pack_choose_layout": ("paged_jax.platform.cpu", "CpuPlatform", "serving_linear"),
    "pack_layer_matrices": ("paged_jax.worker.step_model", "", "layer_matrices_as"),
    "pack_lm_head": ("paged_jax.platform.cpu_linear", "F32ColumnsLinear", "pack_head"),  # f32 (the default dtype)
    "native_kernel_build": ("cpu_kernels.build", "", "library_path"),
    "warm_up": ("paged_jax.worker.model_runner", "ModelRunner", "warm_up"),
    "executable_cache_read": ("paged_jax.worker.executable_cache", "ExecutableCache", "_load"),
    "executable_cache_write": ("paged_jax.worker.executable_cache", "ExecutableCache", "_store"),
}
_PACKING = ("pack_unstack_layers", "pack_choose_layout", "pack_layer_matrices", "pack_lm_head")


class _Timeline:
    """Wall-clock intervals of the hooked phases and JAX's compile events, in seconds
    since the process was spawned."""

    def __init__(self, spawn: float):
        self.spawn = spawn
        self.calls: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.events: list[tuple[float, str, float]] = []  # (time, name, seconds or 1 for a count)
        self.buckets: list[tuple[int, int, float]] = []  # (num_seqs, num_tokens, start) in warm-up order

    def now(self) -> float:
        return time.time() - self.spawn

    def hook(self, phase: str, module_name: str, owner_name: str, attr: str) -> bool:
        import importlib
        try:
            owner = importlib.import_module(module_name)
            owner = getattr(owner, owner_name) if owner_name else owner
            original = owner.__dict__[attr] if owner_name else getattr(owner, attr)
        except (ImportError, AttributeError, KeyError):
            return False
        is_static = isinstance(original, staticmethod)
        function = original.__func__ if is_static else original

        def timed(*args, **kwargs):
            start = self.now()
            try:
                return function(*args, **kwargs)
            finally:
                self.calls[phase].append((start, self.now()))
        setattr(owner, attr, staticmethod(timed) if is_static else timed)
        return True

    def seconds(self, phase: str, hooked: set) -> float | None:
        """Wall seconds in `phase`'s calls, nested calls counted once; None if not hooked."""
        if phase not in hooked:
            return None
        spans = sorted(self.calls.get(phase, []))
        total, end = 0.0, float("-inf")
        for a, b in spans:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return round(total, 3)

    def compile_events(self, start: float, end: float) -> dict:
        """JAX's compile figures between two times: seconds per duration event, and counts."""
        out: dict[str, float] = collections.defaultdict(float)
        for t, name, value in self.events:
            if start <= t <= end:
                out[name] += value
        short = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
                 # compiling, or reading the compiled program from the persistent cache
                 "/jax/core/compile/backend_compile_duration": "compile_or_read_s",
                 "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s",
                 "/jax/compilation_cache/cache_hits": "cache_hits",
                 "/jax/compilation_cache/cache_misses": "cache_misses",
                 "/jax/compilation_cache/compile_requests_use_cache": "programs"}
        return {label: round(out.get(name, 0.0), 3) for name, label in short.items()}


def child(path: str, options: dict) -> None:
    """One start-up, as a user's script does it (no absl: its logging would show JAX's INFO
    lines, which a plain script does not); writes its figures to `path`. `options`: the
    parent's flags (model, engine settings, prompt, max_tokens)."""
    spawn = float(os.environ[_SPAWN_ENV])
    line = _Timeline(spawn)
    t_main = line.now()
    import jax
    t_jax = line.now()
    jax.monitoring.register_event_duration_secs_listener(lambda name, s, **_: line.events.append((line.now(), name, s)))
    jax.monitoring.register_event_listener(lambda name, **_: line.events.append((line.now(), name, 1.0)))
    from paged_jax import LLM, SamplingParams
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    t_import = line.now()
    hooked = {phase for phase, where in _HOOKS.items() if line.hook(phase, *where)}
    if "warm_up" in hooked:  # bucket boundaries: warm-up builds one empty batch per bucket
        from paged_jax.worker.model_runner import ModelRunner
        empty_batch = ModelRunner.empty_batch

        def marked(runner, num_seqs, num_tokens):
            line.buckets.append((num_seqs, num_tokens, line.now()))
            return empty_batch(runner, num_seqs, num_tokens)
        ModelRunner.empty_batch = marked
    caches = []  # every ExecutableCache warm-up used, for its counts
    from paged_jax.worker.executable_cache import ExecutableCache
    load_or_compile = ExecutableCache.load_or_compile

    def counted(cache, *args):
        if not any(c is cache for c in caches):
            caches.append(cache)
        return load_or_compile(cache, *args)
    ExecutableCache.load_or_compile = counted
    enable_compilation_cache()  # $PAGED_JAX_CACHE_DIR: the parent's directory
    settings = {k: options[k] for k in _ENGINE_SETTINGS if options.get(k) is not None}
    t_llm = line.now()
    model, tiny = options["model"], options["model"].startswith("tiny_")
    if tiny:  # random weights, no tokenizer: load it here (what load_model does for a named model)
        from experiments.bench_models import load_for_benchmark
        model = load_for_benchmark(model, options.get("max_model_len") or 64)
        line.calls["model_load"].append((t_llm, line.now()))
    llm = LLM(model, **settings)
    t_ready = line.now()
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]} if tiny else options["prompt"]
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=options["max_tokens"]), use_tqdm=False)
    t_done = line.now()

    warm = line.calls.get("warm_up", [(t_ready, t_ready)])[0]
    buckets = []
    for i, (s, t, start) in enumerate(line.buckets):
        end = line.buckets[i + 1][2] if i + 1 < len(line.buckets) else warm[1]
        buckets.append({"num_seqs": s, "num_tokens": t, "seconds": round(end - start, 3),
                        **line.compile_events(start, end)})
    phases = {"python_start": t_main, "import_jax": t_jax - t_main, "import_paged_jax": t_import - t_jax,
              "llm_init": t_ready - t_llm, "first_generate": t_done - t_ready}
    phases = {k: round(v, 3) for k, v in phases.items()}
    phases.update({p: line.seconds(p, hooked) for p in _HOOKS})
    packing = [phases[p] for p in _PACKING]
    phases["weight_packing"] = None if None in packing else round(sum(packing), 3)
    usage, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = {
        "ready_s": round(t_ready, 3),  # spawn -> LLM() returned: what a user waits for
        "total_s": round(t_done, 3),  # ... and the first generate done
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),  # this process's threads
        "cpu_children_s": round(children.ru_utime + children.ru_stime, 3),  # the C++ compiler's, when it ran
        "phases_s": phases,
        "hooks_missing": sorted(set(_HOOKS) - hooked),
        "compile": {"before_llm": line.compile_events(0.0, t_llm), "llm_init": line.compile_events(t_llm, t_ready),
                    "warm_up": line.compile_events(*warm), "first_generate": line.compile_events(t_ready, t_done)},
        "warm_up_buckets": buckets,
        "executable_cache": {"hits": sum(c.hits for c in caches), "misses": sum(c.misses for c in caches),
                             "unreadable": sum(c.errors for c in caches),
                             "read_s": round(sum(c.load_seconds for c in caches), 3)},
        "output_token_ids": list(out.outputs[0].token_ids),
    }
    with open(path, "w") as f:
        json.dump(figures, f)


def run_once(label: str, cache_dir: str, kernel_dir: str | None, options: dict) -> dict:
    """One start-up in a fresh process; its figures, the console it showed and the load.
    `kernel_dir`: the native kernels' cache (None: the user's)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    env = {**os.environ, "PAGED_JAX_CACHE_DIR": cache_dir, _SPAWN_ENV: repr(time.time())}
    if kernel_dir is not None:
        env["PAGED_JAX_KERNEL_CACHE_DIR"] = kernel_dir
    load = os.getloadavg()[0]
    script = "import json, sys\nfrom experiments.startup_time import child\nchild(sys.argv[1], json.loads(sys.argv[2]))"
    proc = subprocess.run([sys.executable, "-c", script, out_path, json.dumps(options)],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"the {label} start-up failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out_path) as f:
        figures = json.load(f)
    os.unlink(out_path)
    console = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return {"run": label, "load_average_1min_before": round(load, 2), **figures, "console": console[-40:]}


def main(argv):
    del argv
    from experiments.reporting.results_io import cpu_model
    options = {"model": _MODEL.value, "max_num_seqs": _MAX_NUM_SEQS.value,
               "max_num_batched_tokens": _MAX_TOKENS_PER_STEP.value, "max_model_len": _MAX_MODEL_LEN.value,
               "prompt": _PROMPT.value, "max_tokens": _MAX_TOKENS.value}
    work = tempfile.mkdtemp(prefix="paged_jax_startup_")
    try:
        cache_dir = os.path.join(work, "jax")
        kernel_dir = os.path.join(work, "cpu_kernels") if _COLD_KERNELS.value else None
        runs = [run_once("cold", cache_dir, kernel_dir, options)]
        runs += [run_once(f"warm{i + 1}" if _WARM_RUNS.value > 1 else "warm", cache_dir, kernel_dir, options)
                 for i in range(_WARM_RUNS.value)]
        cache_files = len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0
        executables_dir = cache_dir + "-executables"  # executable_cache.executable_cache_dir()
        executable_files = len(os.listdir(executables_dir)) if os.path.isdir(executables_dir) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in runs:
        p = r["phases_s"]
        print(f"{r['run']:>6}: ready {r['ready_s']:6.1f}s  (import {p['import_jax'] + p['import_paged_jax']:.1f}, "
              f"load {p['model_load']}, packing {p['weight_packing']}, warm-up {p['warm_up']}, "
              f"{r['executable_cache']['hits']} programs from the executable cache; "
              f"cpu {r['cpu_s']:.1f}s)  first generate {p['first_generate']:.2f}s")
    figures = {"model": _MODEL.value, "cpu": cpu_model() or "unknown", "note": _NOTE.value,
               "cache_entries_after": cache_files, "executable_cache_entries_after": executable_files,
               "greedy_outputs_equal": all(r["output_token_ids"] == runs[0]["output_token_ids"] for r in runs),
               "runs": runs}
    if not _OUTPUT.value:
        print(json.dumps(figures, indent=1))
        return
    from experiments.reporting.results_io import write_result
    flag_values = {**options, "warm_runs": _WARM_RUNS.value, "cold_kernel_cache": _COLD_KERNELS.value,
                   "note": _NOTE.value}
    print(f"wrote {write_result(_OUTPUT.value, flags=flag_values, figures=figures)}")


if __name__ == "__main__":
    app.run(main)
