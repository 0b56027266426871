"""Offline throughput on an accelerator, with the device's busy fraction and the decode roofline.

    python -m experiments.gpu_bench --model=smollm2_135m --output=gpu_bench_h100_smollm2_135m
    python -m experiments.gpu_bench --engine=hf_continuous --model=smollm2_135m \
        --against=gpu_bench_h100_smollm2_135m --output=gpu_bench_h100_peer_hf
    bash experiments/gpu_bench.sh h100                   # every stage, on a lent GPU
    DRY_RUN=1 bash experiments/gpu_bench.sh dry          # the same on CPU, tiny shapes, seconds

Why: the engine is built for accelerators, and its figures there must be measured, not
inferred from CPU records. One run of --engine=paged_jax (the default):
  1. a configs preset (--model) with random weights in --dtype (bf16: the real weights are
     too large to carry to a lent machine, and throughput does not depend on their values)
     served by `LLM` with the platform's defaults (on GPU: 256 sequences, 8192 tokens per
     step, the KV cache from free device memory, async scheduling), only max_model_len set;
  2. a ShareGPT-like trace (experiments/benchmarks/workloads.py: --num_requests requests at
     t=0, log-normal lengths around 161 prompt / 338 output tokens, greedy, EOS ignored) run
     --rounds times: output tok/s is useful output tokens over generation wall time; the
     engine's start-up (every step program compiled) is timed apart;
  3. a decode window: --window_seqs sequences (default the engine's max_num_seqs) all
     decoding, --window_steps steps timed, then as many again under `jax.profiler.trace`;
     the device's busy time in them is read from the trace (experiments/gpu_bench_profile.py)
     and set against the untraced window's wall time (the profiler's host tracing could only
     slow the host, which the device waits for); the untraced steps' host phases (schedule,
     stats, runner host work, core update, outputs: experiments/engine_overhead.py's split)
     say where the host's time goes;
  4. the decode roofline of that window's step: the weights as served plus every sequence's
     K/V (each byte read once per step) over the device's measured memory bandwidth
     (experiments/benchmarks/device_ceilings.py; experiments/benchmarks/step_bytes.py counts
     the bytes, as for experiments/roofline.py on CPU), beside the step's matmul FLOPs over
     a measured bf16 matmul rate; the larger is the floor, and its sequences over it the
     roofline's output tok/s.
--engine=hf_continuous runs Hugging Face transformers' continuous batching (experiments/peer_hf.py's
hf_continuous) on the same trace and device, with a model of the same shapes and dtype
(transformers' own random initialization), and sets its tok/s against the paged_jax record
named by --against. The record is written after each part, so a stage stopped by its time
limit keeps what it finished. Writes <results_dir>/<output>.json (default experiments/results).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags


# flags are defined only when run (see the end): importing this module (the tests) defines none
def _define_flags():
    flags.DEFINE_string("model", "smollm2_135m", "configs preset, served with random weights.")
    flags.DEFINE_enum("engine", "paged_jax", ["paged_jax", "hf_continuous"], "Which engine serves the trace.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights' dtype (both engines).")
    flags.DEFINE_integer("num_requests", 512, "Requests in the ShareGPT-like trace (all at t=0).")
    flags.DEFINE_float("scale", 1.0, "Length scale of the trace (1: ShareGPT's means).")
    flags.DEFINE_integer("max_model_len", 2048, "Prompt + output cap (trace and engine).")
    flags.DEFINE_integer("rounds", 1, "Runs of the trace (output tok/s: their median).")
    flags.DEFINE_integer("window_seqs", 0, "Sequences of the decode window (0: the engine's max_num_seqs).")
    flags.DEFINE_integer("window_steps", 32, "Decode steps timed, and as many again traced (0: no window).")
    flags.DEFINE_integer("max_num_seqs", 0, "EngineConfig.max_num_seqs (0: the platform's default).")
    flags.DEFINE_integer("max_num_batched_tokens", 0, "EngineConfig.max_num_batched_tokens (0: the platform's).")
    flags.DEFINE_list("seq_buckets", [], "EngineConfig.seq_buckets (empty: the defaults).")
    flags.DEFINE_list("token_buckets", [], "EngineConfig.token_buckets (empty: the defaults).")
    flags.DEFINE_integer("kv_cache_mib", 0, "EngineConfig.kv_cache_memory_bytes in MiB (0: the platform's).")
    flags.DEFINE_integer("bandwidth_mib", 1024, "Array size of the memory-bandwidth probe, MiB.")
    flags.DEFINE_integer("matmul_size", 8192, "Side of the square bf16 matmul of the FLOP-rate probe.")
    flags.DEFINE_integer("hf_num_blocks", 0, "hf_continuous: its KV cache's blocks (0: what it infers from free "
                         "memory).")
    flags.DEFINE_string("against", "", "hf_continuous: the paged_jax record (a name in --results_dir) to compare.")
    flags.DEFINE_integer("seed", 0, "Trace seed.")
    flags.DEFINE_string("output", "gpu_bench", "Result name: <results_dir>/<output>.json.")
    flags.DEFINE_string("results_dir", "", "Where records go (empty: experiments/results).")


FLAGS = flags.FLAGS


def random_weights(preset: str, max_model_len: int, dtype: str):
    """bench_models.random_model's model (init key 0, source random:<preset>), its weights made by
    one jitted program rather than op by op: eagerly, each matrix's float32 draw and scaled copy
    are freed after its cast, leaving holes between the weights in XLA's memory pool (gigabytes
    each for Llama-3.1-8B's stacked MLP), where the KV cache, sized from the free memory that
    includes them, must then find one contiguous region; jitted, they never leave the program."""
    import jax
    import jax.numpy as jnp

    import configs
    from experiments.bench_models import RANDOM_PREFIX
    from paged_jax.loading import LoadedModel
    from paged_jax.model.llama import init_params
    cfg = configs.get_config(preset)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_model_len))
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), jnp.dtype(dtype))
    return LoadedModel(cfg, jax.block_until_ready(params), None, f"{RANDOM_PREFIX}{preset}", "memory", 0.0)


def decode_roofline(cfg, num_seqs: int, mean_context: float, weight_bytes: int, kv_itemsize: int,
                    bandwidth_gbs: float, matmul_tflops: float | None) -> dict:
    """The floor of a decode step of `num_seqs` sequences at `mean_context` tokens each: bytes
    (weights once, every sequence's K/V once per layer) over the bandwidth, beside its matmul
    FLOPs (projections, MLP and LM head of one token per sequence, 2 per multiply-add) over the
    matmul rate; the larger bounds the step, and num_seqs over it the output tok/s."""
    from experiments.benchmarks.step_bytes import kv_read_bytes
    kv_bytes = kv_read_bytes(cfg, [mean_context] * num_seqs, kv_itemsize)
    memory_ms = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9) * 1e3
    h = cfg.hidden_size
    per_token = cfg.num_layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size)
    flop = 2 * num_seqs * (per_token + h * cfg.vocab_size)
    compute_ms = flop / (matmul_tflops * 1e12) * 1e3 if matmul_tflops else None
    floor_ms = max(memory_ms, compute_ms or 0.0)
    return {"weight_bytes": weight_bytes, "kv_bytes": int(kv_bytes), "memory_ms": round(memory_ms, 4),
            "matmul_gflop": round(flop / 1e9, 3), "compute_ms": None if compute_ms is None else round(compute_ms, 4),
            "bound": "memory" if memory_ms >= (compute_ms or 0.0) else "compute", "roofline_ms": round(floor_ms, 4),
            "roofline_output_tokens_per_s": round(num_seqs / floor_ms * 1e3, 1)}


def busy_figures(wall_s: float, traced_wall_s: float | None, steps: int, busy: dict) -> dict:
    """Per-step wall and device-busy times of the window, and the busy fraction: busy over the
    untraced wall time (the headline) and over the traced wall time."""
    out = {"wall_ms_per_step": round(wall_s / steps * 1e3, 4),
           "traced_wall_ms_per_step": None if traced_wall_s is None else round(traced_wall_s / steps * 1e3, 4),
           "device": busy}
    if busy.get("available"):
        per_step = busy["busy_ms"] / steps
        out.update(device_busy_ms_per_step=round(per_step, 4),
                   device_busy_fraction=round(per_step / out["wall_ms_per_step"], 4),
                   device_busy_fraction_traced=round(busy["busy_ms"] / (traced_wall_s * 1e3), 4))
    return out


def window_prompts(requests, num_seqs: int, room: int, max_model_len: int) -> list[list[int]]:
    """`num_seqs` prompts of the trace (in order, repeated if it has too few) that leave `room`
    tokens of output under max_model_len, so that no sequence finishes inside the window."""
    fitting = [list(r.prompt_token_ids) for r in requests if len(r.prompt_token_ids) + room <= max_model_len]
    if not fitting:
        raise ValueError(f"no prompt of the trace leaves {room} tokens under max_model_len={max_model_len}")
    return [fitting[i % len(fitting)] for i in range(num_seqs)]


def decode_window(llm, prompts: list[list[int]], steps: int, log_dir: str) -> dict:
    """Serve `prompts` until every one decodes, time `steps` steps (and their host phases), trace
    `steps` more, abort them all."""
    from experiments.benchmarks.phase_timer import PhaseTimer, summarize
    from experiments.gpu_bench_profile import traced_device_busy
    from paged_jax.core.sampling_params import SamplingParams
    engine, n = llm.engine, len(prompts)
    max_len = engine.config.max_model_len
    for i, prompt in enumerate(prompts):
        engine.add_request(f"window{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=max_len - len(prompt), ignore_eos=True))
    log = engine.stats_tracker.step_log
    full = 0
    for _ in range(4 * steps + 64 + sum(map(len, prompts)) // engine.config.max_num_batched_tokens):
        logged = len(log)
        engine.step()
        full = full + 1 if len(log) > logged and log[-1][0] == log[-1][1] == n else 0
        if full == 2:  # two steps in a row with every sequence decoding: the prefills are done
            break
    else:
        raise RuntimeError(f"the window's {n} sequences never all decoded together (max_num_seqs "
                           f"{engine.config.max_num_seqs}, KV blocks {engine.config.num_blocks})")
    running = engine.scheduler.running
    context_start = statistics.mean(s.num_tokens for s in running)
    timer = PhaseTimer(engine)  # the host's phases of each step from here on (engine_overhead.py's split)

    def run():
        for _ in range(steps):
            engine.step()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    try:
        traced_wall, busy = traced_device_busy(run, log_dir)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run here is a result, recorded
        run()  # the window's second half, untraced, so that the check below stays the same
        traced_wall, busy = None, {"available": False, "reason": f"the profiler failed: {type(e).__name__}: {e}"}
    window_log = list(log)[-2 * steps:]
    context_end = statistics.mean(s.num_tokens for s in engine.scheduler.running)
    for i in range(n):
        engine.abort_request(f"window{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {"num_seqs": n, "steps": steps, "mean_context": round((context_start + context_end) / 2, 1),
            "all_steps_full_decode": len(window_log) == 2 * steps and all(s == t == n for s, t, *_ in window_log),
            **busy_figures(wall, traced_wall, steps, busy),
            # medians over the untraced steps: where the host's time goes ("device" is the time it
            # waits inside device calls, not the device's own time: see device_busy_fraction)
            "host_phases": summarize(timer.steps[:steps])}


def step_programs(runner) -> int:
    """The step programs warm-up compiled: a program per bucket shape and step kind
    (ModelRunner.step_kinds), times the fused head's two variants (greedy, sampling)."""
    return sum(map(len, runner.step_kinds().values())) * (2 if runner.fused_head else 1)


def engine_settings() -> dict:
    """EngineConfig fields the flags set (0 / empty: left to the platform)."""
    out = {name: getattr(FLAGS, name) for name in ("max_num_seqs", "max_num_batched_tokens") if getattr(FLAGS, name)}
    out.update({name: tuple(int(b) for b in getattr(FLAGS, name)) for name in ("seq_buckets", "token_buckets")
                if getattr(FLAGS, name)})
    if FLAGS.kv_cache_mib:
        out["kv_cache_memory_bytes"] = FLAGS.kv_cache_mib * 2**20
    return out


def run_paged_jax(requests, figures: dict, save) -> None:
    import jax
    import jax.numpy as jnp

    from experiments.benchmarks.device_ceilings import matmul_rate, memory_bandwidth
    from experiments.benchmarks.step_bytes import served_weight_bytes
    from paged_jax.worker.kv_cache import bytes_per_block
    from paged_jax.core.sampling_params import SamplingParams
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.worker.batch_inputs import all_batch_shapes
    # the ceilings first: their arrays are freed before the engine sizes its cache from free memory
    device = jax.devices()[0]
    figures["memory_bandwidth"] = memory_bandwidth(device, FLAGS.bandwidth_mib * 2**20)
    figures["matmul_rate"] = matmul_rate(device, FLAGS.matmul_size, "bfloat16")
    loaded = random_weights(FLAGS.model, FLAGS.max_model_len, FLAGS.dtype)
    start = time.perf_counter()
    llm = LLM(loaded, max_model_len=FLAGS.max_model_len, dtype=FLAGS.dtype, seed=FLAGS.seed, show_progress=False,
              **engine_settings())
    config = llm.engine.config
    figures.update(model=loaded.source, setup_s=round(time.perf_counter() - start, 1), engine_settings={
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "num_step_shapes": len(all_batch_shapes(config.seq_buckets, config.token_buckets)),
        "num_step_programs": step_programs(llm.engine.runner),
        "num_blocks": config.num_blocks, "block_size": config.block_size,
        "kv_cache_gib": round(config.num_blocks * bytes_per_block(loaded.config, config.block_size,
                                                                  config.kv_cache_dtype) / 2**30, 2),
        "gpu_memory_utilization": config.gpu_memory_utilization, "async_scheduling": llm.engine.core.async_scheduling,
        "attention_backend": config.attention_backend, "kv_cache_dtype": config.kv_cache_dtype,
        "layer_loop": config.layer_loop})
    print(f"{FLAGS.model}: engine ready in {figures['setup_s']} s: {figures['engine_settings']}", flush=True)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    rates, walls = [], []
    for _ in range(FLAGS.rounds):
        llm.reset_prefix_cache()  # every round starts cold
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(round(generated / walls[-1], 1))
        print(f"{FLAGS.model}: {rates[-1]} output tok/s ({walls[-1]:.2f} s, {generated} tokens)", flush=True)
    stats = device.memory_stats() or {}  # XLA's allocator: how much of its limit the cache and the steps took
    figures.update(output_tokens_per_s=statistics.median(rates), output_tokens_per_s_per_round=rates,
                   wall_s_per_round=[round(w, 2) for w in walls], generated_tokens=generated,
                   num_compilations_after_warm_up=llm.stats()["num_compilations_after_warm_up"],
                   device_memory_gib={k: round(stats[k] / 2**30, 2) for k in
                                      ("bytes_limit", "bytes_in_use", "peak_bytes_in_use") if k in stats})
    save()
    if FLAGS.window_steps:
        n = min(FLAGS.window_seqs or config.max_num_seqs, config.max_num_seqs)
        room = 4 * FLAGS.window_steps + 64
        with tempfile.TemporaryDirectory() as log_dir:
            window = decode_window(llm, window_prompts(requests, n, room, FLAGS.max_model_len), FLAGS.window_steps,
                                   log_dir)
        window["roofline"] = decode_roofline(
            loaded.config, n, window["mean_context"], served_weight_bytes(llm.engine.runner),
            jnp.dtype(config.kv_cache_dtype).itemsize, figures["memory_bandwidth"]["GB_per_s"],
            figures["matmul_rate"]["TFLOP_per_s"])
        window["step_over_roofline"] = round(window["wall_ms_per_step"] / window["roofline"]["roofline_ms"], 2)
        figures["decode_window"] = window
        print(f"{FLAGS.model}: decode window {window['num_seqs']} seqs at context {window['mean_context']}: "
              f"{window['wall_ms_per_step']} ms/step, device busy {window.get('device_busy_fraction', 'unavailable')}"
              f"; roofline {window['roofline']['roofline_ms']} ms ({window['roofline']['bound']})", flush=True)
        save()


def run_hf(requests, figures: dict, save) -> None:
    import torch

    from experiments.gpu_bench_peer import hf_model
    from experiments.peer_hf import hf_continuous
    save()  # the record's environment starts JAX now, before torch holds the GPU's memory
    model, device = hf_model(FLAGS.model, FLAGS.dtype, FLAGS.seed)
    figures.update(model=f"transformers-initialized random weights, {FLAGS.model}'s shapes", torch_device=device,
                   device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    try:
        _, hf = hf_continuous(model, requests, progress=False, warmup=device == "cuda",
                              num_blocks=FLAGS.hf_num_blocks or None)
    except Exception as e:  # noqa: BLE001 - a peer that fails here is a result, recorded
        hf = {"error": f"{type(e).__name__}: {e}"}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    figures["hf_continuous"] = hf
    figures["output_tokens_per_s"] = hf.get("output_tokens_per_s")
    if FLAGS.against and "error" not in hf:
        path = os.path.join(FLAGS.results_dir or _results_dir(), f"{FLAGS.against}.json")
        try:
            with open(path) as f:
                ours = json.load(f)["figures"]
            figures["against"] = {"record": FLAGS.against, "paged_jax_output_tokens_per_s": ours["output_tokens_per_s"],
                                  "same_trace": all(ours.get(k) == figures[k] for k in
                                                    ("num_requests", "mean_prompt_tokens", "mean_output_tokens")),
                                  "throughput_ratio": round(ours["output_tokens_per_s"] / hf["output_tokens_per_s"],
                                                            2)}
        except (OSError, KeyError) as e:
            figures["against"] = {"record": FLAGS.against, "error": f"{type(e).__name__}: {e}"}
    print(f"hf continuous batching: {hf}; against: {figures.get('against')}", flush=True)
    save()


def _results_dir() -> str:
    from experiments.reporting.results_io import RESULTS_DIR
    return RESULTS_DIR


def main(argv):
    del argv
    import jax

    from experiments.benchmarks.workloads import make_trace, trace_means
    from experiments.reporting.results_io import write_result
    import configs
    cfg = configs.get_config(FLAGS.model)
    requests = make_trace("sharegpt", FLAGS.num_requests, seed=FLAGS.seed, scale=FLAGS.scale,
                          max_model_len=FLAGS.max_model_len, vocab_size=cfg.vocab_size)
    figures = {"engine": FLAGS.engine, "preset": FLAGS.model, "dtype": FLAGS.dtype, "workload": "sharegpt",
               "num_requests": len(requests), **trace_means(requests, digits=1),
               "useful_output_tokens": sum(r.max_tokens for r in requests)}
    if FLAGS.engine == "paged_jax":
        figures["device"] = jax.devices()[0].device_kind
    flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}

    def save():
        return write_result(FLAGS.output, flags=flag_values, figures=figures, seed=FLAGS.seed,
                            results_dir=FLAGS.results_dir or _results_dir())
    (run_paged_jax if FLAGS.engine == "paged_jax" else run_hf)(requests, figures, save)
    print("wrote", save())


if __name__ == "__main__":
    _define_flags()
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
