"""Where a decode step's wall time goes: host phases, device time, and how long the device idles.

    python -m experiments.engine_overhead                         # tiny Llama, 64 sequences, both runners
    python -m experiments.engine_overhead --model=smollm2-135m --runners=model
    python -m experiments.engine_overhead --num_seqs=128 --runners=model --paper_metrics=false  # async vs not

Why: on an accelerator a small model's step is a few ms of device work, as long as the
engine's Python; run strictly in sequence (schedule -> prepare -> dispatch -> wait -> read
back -> process outputs), every ms of host work is a ms the device idles. This script
splits a decode step of --num_seqs sequences into its phases, timed by wrapping the
engine's own parts (nothing in the engine is changed for it):

  schedule      Scheduler.schedule (the block manager's allocations included)
  stats         EngineStats.record_schedule + record_step (the paper's figures only with
                EngineConfig.paper_metrics, which every setting runs both ways, A B A B)
  runner_host   ModelRunner.execute less its device time: batch preparation, dispatch,
                reading the tokens back
  device        the runner's device seconds (inside its jitted calls, waiting included)
  core_update   the rest of EngineCore.step: appending tokens, stop checks, outputs, pool check
  outputs       LLMEngine's output processing (detokenization, stop strings, RequestOutputs)

and reports per step (median over the steps that decode every sequence, lowest median
over --rounds: other work shares these CPUs, and a disturbed round only raises it) the
host total (step wall time less device time) and the device's idle fraction (host / wall).
With --runners=host_only the device part is absent (experiments/benchmarks/host_only_runner.py:
the real batch preparation, random tokens), isolating the engine's own host work.

The model runner runs with async scheduling off and on (EngineConfig.async_scheduling). With
it on, the host's phases overlap the device's step, so host time no longer measures idle
time: for both, the record also holds the device's own time for the step (`device_step_ms`:
the same decode batch dispatched back to back, `phase_timer.device_step_seconds`, on each
engine's last batch; the lowest of these, since it is one program and shape) and the idle
fraction it implies, 1 - device_step_ms / step wall time (`device_idle_estimate`). On a
CPU the "device" is the host's own cores, so overlapped host work also slows the step itself;
that shows here as idle time too.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from experiments.benchmarks.phase_timer import PhaseTimer, decode_steps, summarize

_MODEL = flags.DEFINE_string("model", "tiny_llama", "Model (any load_model source) or a tiny_* preset.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "smollm2-135m",
                                 "Registered model whose tokenizer decodes the outputs (for tiny_* presets).")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 64, "Sequences decoding together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 64, "Output tokens per sequence (ignore_eos).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "A B A B rounds over the settings; each counts its lowest median.")
_RUNNERS = flags.DEFINE_multi_enum("runners", ["model", "host_only"], ["model", "host_only"],
                                   "model: the real runner; host_only: batch preparation only, random tokens.")
_PAPER = flags.DEFINE_multi_enum("paper_metrics", ["false", "true"], ["false", "true"],
                                 "EngineConfig.paper_metrics values to run.")
_ASYNC = flags.DEFINE_multi_enum("async_scheduling", ["false", "true"], ["false", "true"],
                                 "EngineConfig.async_scheduling values to run (the model runner only: the "
                                 "host-only runner has no dispatch).")
_OUTPUT = flags.DEFINE_string("output", "engine_overhead", "Result name: experiments/results/<output>.json.")

def main(argv):
    del argv
    import jax
    import numpy as np

    from experiments.bench_models import load_for_benchmark
    from experiments.benchmarks.host_only_runner import HostOnlyRunner
    from experiments.benchmarks.phase_timer import device_step_seconds
    from experiments.reporting.results_io import write_result
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
    from paged_jax.loading.registry import resolve
    from paged_jax.model.llama import init_params
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.worker.model_runner import ModelRunner
    enable_compilation_cache()
    n, prompt_len, output_len = _NUM_SEQS.value, _PROMPT_LEN.value, _OUTPUT_LEN.value
    max_len = -(-(prompt_len + output_len) // 64) * 64
    model = load_for_benchmark(_MODEL.value, max_len)
    if model.tokenizer is None:  # a random-weight preset speaks the tokenizer's vocabulary (its tokens decode)
        tokenizer = load_gguf_tokenizer(resolve(_TOKENIZER.value))
        cfg = dataclasses.replace(model.config, vocab_size=len(tokenizer))
        model = dataclasses.replace(model, config=cfg, params=init_params(cfg, jax.random.key(0)), tokenizer=tokenizer,
                                    source=f"{model.source} with {_TOKENIZER.value}'s tokenizer and vocabulary")
    base = EngineConfig(max_model_len=max_len, max_num_seqs=n, max_num_batched_tokens=n * prompt_len, block_size=16,
                        num_blocks=n * (max_len // 16) + 8, seq_buckets=(n,), token_buckets=(n, n * prompt_len),
                        enable_prefix_caching=False)
    settings = [(runner, paper == "true", overlap == "true") for runner in _RUNNERS.value for paper in _PAPER.value
                for overlap in (_ASYNC.value if runner == "model" else ["false"])]
    engines, batches = {}, {}
    for runner, paper, overlap in settings:
        factory = {"model": ModelRunner, "host_only": HostOnlyRunner}[runner]
        config = dataclasses.replace(base, paper_metrics=paper, async_scheduling=overlap)
        engine = LLMEngine(model, config, runner_factory=factory, final_outputs_only=True)
        if runner == "model":  # keep the last decode batch: the device's own step time is measured on it
            _keep_last_batch(engine.runner, batches, (runner, paper, overlap))
        engines[runner, paper, overlap] = (engine, PhaseTimer(engine))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    runs = {setting: [] for setting in settings}
    for _ in range(_ROUNDS.value):  # A B A B: each round runs every setting once
        prompts = [rng.integers(3, model.config.vocab_size, prompt_len).tolist() for _ in range(n)]
        for setting in settings:
            engine, timer = engines[setting]
            runs[setting].append(summarize(decode_steps(engine, prompts, params, timer)))
    # the device's own time for the decode step, measured on every model engine's last batch (the same
    # program and shape): the lowest is the step's time, the others were slowed by whatever else ran
    measured = {key: 1e3 * device_step_seconds(engines[key][0].runner, batch) for key, batch in batches.items()}
    device_ms = min(measured.values(), default=None)
    rows = []
    for (runner, paper, overlap), summaries in runs.items():
        best = min(summaries, key=lambda s: s["wall_ms"])
        row = {"runner": runner, "paper_metrics": paper, "async_scheduling": overlap, **best,
               "host_ms_per_round": [s["host_ms"] for s in summaries],
               "wall_ms_per_round": [s["wall_ms"] for s in summaries]}
        note = f"(device idle {best['device_idle_fraction']:.1%})"
        if runner == "model":
            row["device_step_ms"] = round(device_ms, 3)
            row["device_step_ms_measured"] = round(measured[runner, paper, overlap], 3)
            row["device_idle_estimate"] = round(max(0.0, 1 - device_ms / best["wall_ms"]), 4)
            note = f"(device step {device_ms:.3f} ms: idle {row['device_idle_estimate']:.1%})"
        rows.append(row)
        print(f"{runner:9} paper_metrics={paper!s:5} async={overlap!s:5}: wall {best['wall_ms']} ms/step, host "
              f"{best['host_ms']} {note}; " + ", ".join(f"{p} {v}" for p, v in best["phases_ms"].items()), flush=True)
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, seed=0,
                                figures={"model": model.source, "num_seqs": n, "prompt_len": prompt_len,
                                         "output_len": output_len, "rows": rows}))


def _keep_last_batch(runner, batches: dict, key) -> None:
    """Wrap the runner's step calls so batches[key] is the last batch it ran."""
    dispatch, run_batch = runner.dispatch, runner.run_batch

    def kept_dispatch(*args, **kwargs):
        step = dispatch(*args, **kwargs)
        batches[key] = step.batch
        return step

    def kept_run_batch(batch, *args, **kwargs):
        batches[key] = batch
        return run_batch(batch, *args, **kwargs)
    runner.dispatch, runner.run_batch = kept_dispatch, kept_run_batch


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
