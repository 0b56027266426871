"""The Hugging Face transformers baseline: the same workload, weights and machine as our engine.

    python -m experiments.peer_hf                                  # sharegpt, 32 requests, scale 0.25
    python -m experiments.peer_hf --modes=static,paged_jax --batch_size=16

What a user would run instead of this engine on these CPUs (torch, float32, SmolLM2 from
the same GGUF), so the throughput ratio against it (target: >= 4x) is measured, not assumed:
  static:     `generate` on batches of --batch_size in arrival order, left padded, greedy,
              each batch running to its largest max_tokens (EOS off). Only each request's
              own max_tokens count as output; the rest (overrun) is reported as waste.
  continuous: transformers' own continuous batching (its paged cache), one max_new_tokens
              per request; a failure is recorded in the results, never faked.
  paged_jax:  our engine (ignore_eos, greedy); its outputs are checked against each HF
              mode's token for token, a difference accepted only at a checked near-tie
              (tests/helpers/greedy_check.py), mismatches counted and reported, not fatal.
Throughput is useful output tokens (and requests) per second of generation wall time;
model loading and our engine's warm-up compilation are timed apart and not included.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time

# torch's OpenMP threads spin at every barrier by default; on 2 shared cores (another job
# running) that made a batch-8 matmul ~50x slower (16 ms against 0.3 ms with 1 thread).
# Passive waiting measures transformers, not the spin; it must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from absl import app, flags
from tqdm.auto import tqdm



# flags are defined only when run (see the end): importing this module (experiments/gpu_bench.py
# reuses hf_continuous) defines none, so it cannot clash with another experiment's flags
def _define_flags():
    flags.DEFINE_string("model", "smollm2-135m", "Registered model name (a GGUF both sides load).")
    flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "experiments/benchmarks/workloads.py trace.")
    flags.DEFINE_integer("num_requests", 32, "Requests in the trace (all arrive at t=0).")
    flags.DEFINE_float("scale", 0.25, "Length scale of the trace (CPU-sized runs).")
    flags.DEFINE_integer("batch_size", 8, "Static batch size of the HF `generate` baseline.")
    flags.DEFINE_integer("max_model_len", 1024, "Prompt + output cap (trace and engine).")
    flags.DEFINE_integer("max_num_seqs", 32, "Our engine's sequences per step.")
    flags.DEFINE_list("modes", ["static", "continuous", "paged_jax"], "Which of static, continuous, paged_jax.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")


FLAGS = flags.FLAGS

PAD = 0  # any id: padded positions are masked out


@contextlib.contextmanager
def torch_cpu_settings():
    """2 threads, and denormals flushed: GGUF-dequantized weights hold denormal floats that
    make torch CPU matmuls ~40x slower, which would measure the FPU's slow path, not HF.
    Threads started inside (HF continuous batching's loop) inherit the FP environment."""
    import torch
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def fresh_generation_config(model):
    """transformers fills every None field of a passed GenerationConfig from the model's own;
    a fresh one on the model for the run keeps the checkpoint's defaults out."""
    from transformers import GenerationConfig
    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _throughput(requests, seconds: float) -> dict:
    useful = sum(r.max_tokens for r in requests)
    return {"wall_s": round(seconds, 2), "requests_per_s": round(len(requests) / seconds, 3),
            "output_tokens_per_s": round(useful / seconds, 2), "useful_output_tokens": useful}


def hf_static(model, requests, batch_size: int, progress: bool = True):
    """(outputs, figures): greedy `generate` on left-padded batches in arrival order, each to
    its batch's largest max_tokens; a request's output is its first max_tokens tokens."""
    import torch
    from transformers import GenerationConfig
    outputs, generated, padding = [], 0, 0
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    start = time.perf_counter()
    with fresh_generation_config(model), torch.no_grad():
        for batch in tqdm(batches, desc="hf static", disable=not progress):
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), PAD, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):  # left padding: every row's last prompt token at width - 1
                ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids):] = 1
            new = max(r.max_tokens for r in batch)
            # eos_token_id=[] disables the EOS stop (None would fall back to the model's EOS)
            config = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=[], pad_token_id=PAD)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            assert out.shape == (len(batch), width + new), out.shape
            outputs += [out[row, width:width + r.max_tokens].tolist() for row, r in enumerate(batch)]
            generated += len(batch) * new
            padding += sum(width - len(r.prompt_token_ids) for r in batch)
    figures = _throughput(requests, time.perf_counter() - start)
    figures.update(generated_tokens=generated, overrun_tokens=generated - figures["useful_output_tokens"],
                   padding_prompt_tokens=padding, num_batches=len(batches), batch_size=batch_size)
    return outputs, figures


def hf_continuous(model, requests, progress: bool = True, warmup: bool = False, num_blocks: int | None = None):
    """(outputs, figures) from transformers' continuous batching manager, each request with
    its own max_new_tokens (generate_batch takes one for all); raises if any request fails.
    Like our engine's warm-up, the manager's set-up (allocating its paged cache, ~10 s here;
    with `warmup`, capturing its CUDA graphs on a GPU) is not generation: throughput is over
    the requests' own spans (first scheduled to last finished, perf_counter stamps of its
    GenerationOutput.lifespan), wall_with_setup_s apart. The workload hints and the warm-up
    switch are passed where this transformers version takes them (the lent GPU machines'
    can be older than this host's), as is `num_blocks` (its cache's size; None: what it infers
    from free memory, which on a CPU host is a minute of set-up, too long for a dry run)."""
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                              eos_token_id=-1, pad_token_id=PAD)  # -1: EOS disabled in its manager
    accepted = inspect.signature(model.continuous_batching_context_manager).parameters
    extra = {"warmup": warmup} if "warmup" in accepted else {}
    if "workload_hints" in accepted:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        extra["workload_hints"] = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                                                max_generated_length=max(r.max_tokens for r in requests),
                                                num_requests=len(requests))
    if num_blocks is not None and "continuous_batching_config" in accepted:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        extra["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=num_blocks)
    results = {}
    start = time.perf_counter()
    with fresh_generation_config(model), model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30, **extra) as manager:
        for i, r in enumerate(requests):
            manager.add_request(list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.max_tokens)
        with tqdm(total=len(requests), desc="hf continuous", disable=not progress) as bar:
            while len(results) < len(requests):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError(f"continuous batching loop stopped after {len(results)} requests")
                elif result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                    results[result.request_id] = result
                    bar.update(1)
    wall = time.perf_counter() - start
    outputs = [list(results[f"r{i}"].generated_tokens) for i in range(len(requests))]
    assert [len(o) for o in outputs] == [r.max_tokens for r in requests], "lengths differ from max_tokens"
    spans = [r.lifespan for r in results.values()]
    figures = _throughput(requests, max(end for _, end in spans) - min(begin for begin, _ in spans))
    figures.update(generated_tokens=sum(map(len, outputs)), overrun_tokens=0, padding_prompt_tokens=0,
                   wall_with_setup_s=round(wall, 2))
    return outputs, figures


def paged_jax_run(loaded, requests, max_model_len: int, max_num_seqs: int = 32, progress: bool = True,
                  **engine_settings):
    """(outputs, figures) from our engine, greedy with ignore_eos; construction (which
    compiles every step shape) is timed apart as setup_s. engine_settings: EngineConfig fields."""
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.core.sampling_params import SamplingParams
    start = time.perf_counter()
    llm = LLM(loaded, max_model_len=max_model_len, max_num_seqs=max_num_seqs, **engine_settings)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
                        [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests],
                        use_tqdm=progress)
    figures = _throughput(requests, time.perf_counter() - start)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    stats = llm.stats()
    figures.update(generated_tokens=sum(map(len, outputs)), overrun_tokens=0, padding_prompt_tokens=0,
                   setup_s=round(setup, 2), max_num_seqs=max_num_seqs,
                   num_compilations_after_warm_up=stats["num_compilations_after_warm_up"])
    return outputs, figures


def compare_greedy(model, requests, reference_outputs, outputs) -> dict:
    """benchmarks/vllm_worker.compare_outputs (equal / near-tie / mismatched outputs, where
    each first differs) with the HF model (unpadded prompt) as the logits reference of
    tests/helpers/greedy_check.py's rule."""
    import torch

    from experiments.benchmarks.vllm_worker import compare_outputs

    def next_logits(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float().numpy()
    return compare_outputs([list(r.prompt_token_ids) for r in requests], reference_outputs, outputs, next_logits)


def load_hf_model(name: str):
    import torch
    import transformers

    from paged_jax.loading.registry import resolve
    path = resolve(name)
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def main(argv):
    del argv
    from experiments.reporting.results_io import write_result
    from experiments.benchmarks.workloads import make_trace, trace_means
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    from paged_jax.loading import load_model
    enable_compilation_cache()
    unknown = set(FLAGS.modes) - {"static", "continuous", "paged_jax"}
    if unknown:
        raise app.UsageError(f"unknown modes {sorted(unknown)}")
    loaded = load_model(FLAGS.model)
    requests = make_trace(FLAGS.workload, FLAGS.num_requests, seed=FLAGS.seed, scale=FLAGS.scale,
                          max_model_len=FLAGS.max_model_len, vocab_size=loaded.config.vocab_size)
    with torch_cpu_settings():
        start = time.perf_counter()
        hf_model = load_hf_model(FLAGS.model)
        hf_load = time.perf_counter() - start
    figures = {"model": loaded.source, "hf_load_s": round(hf_load, 1),
               **trace_means(requests, digits=1)}
    outputs = {}
    for mode in FLAGS.modes:
        try:
            if mode == "paged_jax":
                outputs[mode], figures[mode] = paged_jax_run(loaded, requests, FLAGS.max_model_len,
                                                             FLAGS.max_num_seqs)
            else:
                with torch_cpu_settings():
                    outputs[mode], figures[mode] = (hf_static(hf_model, requests, FLAGS.batch_size)
                                                    if mode == "static" else hf_continuous(hf_model, requests))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a result, recorded
            figures[mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{mode} failed: {figures[mode]['error']}")
    if "paged_jax" in outputs:
        ours = figures["paged_jax"]["output_tokens_per_s"]
        with torch_cpu_settings():
            for mode in ("static", "continuous"):
                if mode in outputs:
                    figures[f"paged_jax_vs_{mode}"] = {
                        "throughput_ratio": round(ours / figures[mode]["output_tokens_per_s"], 2),
                        "greedy_check": compare_greedy(hf_model, requests, outputs[mode], outputs["paged_jax"])}
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    print("wrote", write_result("peer_hf", flags=flag_values, figures=figures, seed=FLAGS.seed))
    print(f"\n{FLAGS.workload}: {len(requests)} requests, mean prompt {figures['mean_prompt_tokens']}, "
          f"mean output {figures['mean_output_tokens']} tokens")
    print(f"{'mode':<11}{'wall s':>9}{'req/s':>9}{'out tok/s':>11}{'generated':>11}{'overrun':>9}{'padding':>9}")
    for mode in FLAGS.modes:
        f = figures[mode]
        if "error" in f:
            print(f"{mode:<11} failed: {f['error'][:100]}")
        else:
            print(f"{mode:<11}{f['wall_s']:>9}{f['requests_per_s']:>9}{f['output_tokens_per_s']:>11}"
                  f"{f['generated_tokens']:>11}{f['overrun_tokens']:>9}{f['padding_prompt_tokens']:>9}")
    for mode in ("static", "continuous"):
        if f"paged_jax_vs_{mode}" in figures:
            v = figures[f"paged_jax_vs_{mode}"]
            c = v["greedy_check"]
            print(f"paged_jax / hf {mode}: {v['throughput_ratio']}x throughput; greedy outputs: {c['equal']} equal, "
                  f"{c['near_tie']} near-tie, {c['mismatch']} mismatched {c['mismatched_requests']}")


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
