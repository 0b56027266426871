"""Host time per decode step against output length, with the detokenizer running.

    python -m experiments.host_time_vs_output_len        # tiny Llama + SmolLM2's tokenizer, 32 seqs, 64 vs 1024 tokens

Why: before the engine core / front end split, the engine re-decoded each sequence's
whole output every step to look for stop strings, so a step's host work grew with the
output length (O(L) per step, O(L^2) per sequence). Now the front end decodes only the
new tokens (tokenizers' DecodeStream) and looks for stop strings in the new text only,
so host time per step should not depend on how long the outputs are.

Per --output_lens: --num_seqs prompts of --prompt_len tokens decode that many tokens
(ignore_eos) with a stop string set that never matches, so detokenization and stop
checks run every step; a random-weight model (given the tokenizer's vocabulary) keeps
the device part short, and a real tokenizer (--tokenizer) decodes its tokens. Host time is the engine step's wall time
minus the runner's device time (EngineStats): scheduling, block manager, batch
preparation, output processing. Each length runs per --output_kinds, --repeats times:
cumulative (every running request's RequestOutput holds its whole completion so far,
vLLM's default kind), delta (each holds what is new: the server's streams) and final_only
(an output once a request finished: LLM.generate, the server's whole answers). Reported: median host ms over the steps that decode
all sequences, over the first and last 64 of them, and its two parts there: the engine
core's (scheduling, block tables, batch preparation; all a server's engine thread does)
and output processing (the front end's detokenization, stop strings and RequestOutputs;
a server does it on the event loop). Each window's figure is the lowest of its medians
over the repeats (other work shares these CPUs; a disturbed run only raises a median).

Each setting runs twice: with the real runner, and with a host-only runner (the real
batch preparation, random tokens, no device step: --runners). The second isolates the
engine's own host work: with the model, the host figures also carry what the device
step does to the host code after it (its threads share these 2 cores, its KV working
set grows with the outputs), and they moved by up to 30% between runs here.

Cumulative outputs copy O(length) per step by definition (the token list and the text
of each running completion); delta and final-only output processing, and the engine
core, should be flat. A row's `final_outputs_only` is false for cumulative and delta
(the engine builds per-step outputs), true for final_only, as in records from before the
output kinds.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny_llama", "Model (any load_model source) or a tiny_* preset.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "smollm2-135m",
                                 "Registered model whose tokenizer decodes the outputs (for tiny_* presets).")
_NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "Sequences decoding together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.")
_OUTPUT_LENS = flags.DEFINE_list("output_lens", ["64", "1024"], "Output tokens per sequence, one run each.")
_STOP = flags.DEFINE_string("stop", "never-in-the-output", "A stop string (it should not occur).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per setting; each window counts its lowest median over them.")
_RUNNERS = flags.DEFINE_multi_enum("runners", ["model", "host_only"], ["model", "host_only"],
                                   "model: the real runner (the device step runs); host_only: batch preparation "
                                   "only, random tokens (experiments/benchmarks/host_only_runner.py), isolating "
                                   "the engine's host work from the device step's effect on the host code after it.")
_OUTPUT_KINDS = flags.DEFINE_multi_enum("output_kinds", ["cumulative", "delta", "final_only"],
                                        ["cumulative", "delta", "final_only"],
                                        "SamplingParams.output_kind of the requests (final_only: the engine's "
                                        "final_outputs_only, as LLM.generate).")
_NOTE = flags.DEFINE_string("note", "", "Recorded with the figures: how loaded the machine was, what ran beside it.")
_OUTPUT = flags.DEFINE_string("output", "host_time_vs_output_len", "Result name: experiments/results/<output>.json.")


def _median_ms(values) -> float | None:
    return round(1e3 * statistics.median(values), 3) if values else None


def _decode_steps(engine, prompts, params) -> list[tuple[float, float, float]]:
    """Serve one batch; (host, output processing, device) seconds of each step that
    decoded every sequence. Output processing (the front end's detokenization, stop
    strings and RequestOutputs) is part of host time, timed here on its own."""
    processing, process = [], engine.output_processor.process

    def timed(core_outputs):
        start = time.perf_counter()
        result = process(core_outputs)
        processing.append(time.perf_counter() - start)
        return result

    engine.output_processor.process = timed
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    steps, finished, received = [], [], {}
    delta = params.output_kind.name == "DELTA"  # outputs carry new tokens only: count them all
    while engine.has_unfinished_requests():
        logged, processed = len(engine.stats_tracker.step_log), len(processing)
        for o in engine.step():
            got = len(o.outputs[0].token_ids)
            received[o.request_id] = received.get(o.request_id, 0) + got if delta else got
            if o.finished:
                finished.append(o)
        if len(engine.stats_tracker.step_log) > logged:
            num_seqs, num_tokens, host, device = engine.stats_tracker.step_log[-1]
            if num_seqs == num_tokens == len(prompts):
                steps.append((host, sum(processing[processed:]), device))
    engine.output_processor.process = process
    assert len(finished) == len(prompts) and all(received[o.request_id] == params.max_tokens for o in finished)
    return steps


def main(argv):
    del argv
    import jax
    import numpy as np

    from experiments.bench_models import load_for_benchmark
    from experiments.benchmarks.host_only_runner import HostOnlyRunner
    from experiments.reporting.results_io import write_result
    from paged_jax.config.engine_config import EngineConfig
    from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
    from paged_jax.loading.registry import resolve
    from paged_jax.model.llama import init_params
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.worker.model_runner import ModelRunner
    enable_compilation_cache()
    n, lens = _NUM_SEQS.value, [int(x) for x in _OUTPUT_LENS.value]
    max_len = -(-(_PROMPT_LEN.value + max(lens)) // 64) * 64
    model = load_for_benchmark(_MODEL.value, max_len)
    if model.tokenizer is None:  # a random-weight preset: give it the tokenizer's vocabulary, so that its
        # tokens are the tokenizer's words and pieces (a 256-token vocabulary would be mostly stray bytes)
        tokenizer = load_gguf_tokenizer(resolve(_TOKENIZER.value))
        cfg = dataclasses.replace(model.config, vocab_size=len(tokenizer))
        model = dataclasses.replace(model, config=cfg, params=init_params(cfg, jax.random.key(0)), tokenizer=tokenizer,
                                    source=f"{model.source} with {_TOKENIZER.value}'s tokenizer and vocabulary")
    block_size = 16
    config = EngineConfig(max_model_len=max_len, max_num_seqs=n, max_num_batched_tokens=n * _PROMPT_LEN.value,
                          block_size=block_size, num_blocks=n * (max_len // block_size) + 8, seq_buckets=(n,),
                          token_buckets=(n, n * _PROMPT_LEN.value), enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    rows = []
    for runner, kind in itertools.product(_RUNNERS.value, _OUTPUT_KINDS.value):
        factory = {"model": ModelRunner, "host_only": HostOnlyRunner}[runner]
        final_only = kind == "final_only"
        engine = LLMEngine(model, config, final_outputs_only=final_only, runner_factory=factory)
        for output_len in lens:
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, stop=[_STOP.value],
                                    output_kind=RequestOutputKind[kind.upper()])
            runs = []
            for _ in range(_REPEATS.value):  # the least disturbed run counts (other work shares these CPUs)
                prompts = [rng.integers(3, model.config.vocab_size, _PROMPT_LEN.value).tolist() for _ in range(n)]
                runs.append(_decode_steps(engine, prompts, params))
            steps = min(runs, key=lambda r: statistics.median(h for h, _, _ in r))

            def window(part, at):  # the least disturbed run's median over the window
                return min(_median_ms([part(*step) for step in r[at]]) for r in runs)

            first, last = slice(0, 64), slice(-64, None)
            row = {"runner": runner, "output_len": output_len, "output_kind": kind, "final_outputs_only": final_only,
                   "decode_steps": len(steps),
                   "host_ms_median": _median_ms([h for h, _, _ in steps]),
                   "host_ms_median_first_64": window(lambda h, o, d: h, first),
                   "host_ms_median_last_64": window(lambda h, o, d: h, last),
                   "core_host_ms_median_first_64": window(lambda h, o, d: h - o, first),
                   "core_host_ms_median_last_64": window(lambda h, o, d: h - o, last),
                   "output_processing_ms_median_first_64": window(lambda h, o, d: o, first),
                   "output_processing_ms_median_last_64": window(lambda h, o, d: o, last),
                   "device_ms_median": _median_ms([d for _, _, d in steps]),
                   "host_ms_median_per_run": [_median_ms([h for h, _, _ in r]) for r in runs]}
            rows.append(row)
            print(f"{runner} {kind} output_len {output_len}: host {row['host_ms_median']} ms/step "
                  f"(first 64 {row['host_ms_median_first_64']}, last 64 {row['host_ms_median_last_64']}; engine core "
                  f"{row['core_host_ms_median_first_64']} / {row['core_host_ms_median_last_64']}, output processing "
                  f"{row['output_processing_ms_median_first_64']} / {row['output_processing_ms_median_last_64']}), "
                  f"device {row['device_ms_median']} ms, "
                  f"{len(steps)} steps", flush=True)
        del engine
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, seed=0,
                                figures={"model": model.source, "num_seqs": n, "prompt_len": _PROMPT_LEN.value,
                                         "note": _NOTE.value, "rows": rows}))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
