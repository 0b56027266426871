"""How close the served step comes to this CPU's limits: a roofline of decode and prefill steps.

    python -m experiments.roofline                  # SmolLM2-135M, f32 and bf16, decode 8 / 32 / 64, prefill 256 / 1024
    python -m experiments.roofline --model=tiny_llama --iters=1 --rounds=1 --bandwidth_mib=64 --output=roofline_tiny
                                                    # a dry run of the script (random weights, figures meaningless)

Why: experiments/step_profile.py splits a step into parts and experiments/weight_layout.py
measures single matmuls, but neither says how far the whole step, as served, is from what
the machine can do, or which limit applies: a decode step reads every weight once for a
few rows (memory-bound), a prefill chunk multiplies them by hundreds of rows
(compute-bound). For each --dtypes value this builds the engine (`LLM`, every step shape
compiled at start-up, buckets set to exactly the shapes timed) and times its real step,
`ModelRunner.run_batch` (the jitted model step over the paged KV cache, the greedy head,
results to the host), on hand-built batches with real block tables (distinct, shuffled
blocks) and real contexts: decode steps of --decode_seqs sequences at --context_len
tokens each, and prefill chunks of --prefill_tokens tokens (from position 0, split over
--prefill_seqs sequences; padded to the engine's mixed-step shape, so the head runs on
max(decode_seqs) rows). Per step it reports
  gflop            the model's matmul FLOPs for the real tokens: q/k/v/o and MLP projections
                   of every token, the LM head for each sequence's last token
                   (gflop_executed: for the padded shape; attention_gflop apart: QK^T and PV)
  ceiling_gflops   the measured matmul rate at the step's row count (sequences for decode,
                   tokens for prefill) on MLP-shaped matmuls ([rows, H] x [H, I] and
                   [rows, I] x [I, H]) with num_layers distinct weights of each, so they
                   come from memory: float32 the faster of XLA's jnp.dot and the FMA
                   kernel on 16-column blocks (cpu_kernels/f32_matmul.py, where
                   supported); bfloat16 the fastest of XLA's bf16 x bf16 -> f32 dot
                   ([in, out] and [out, in] weights) and the AMX kernel on packed weights
                   (cpu_kernels/amx_matmul.py, where supported)
  bytes_moved      the weights the step reads (layer matrices and the LM head, in their
                   served dtype and layout) plus the K/V it reads (every sequence's
                   context, every layer), against a measured read bandwidth (a jitted
                   max-reduce over --bandwidth_mib MiB)
and the roofline bound max(gflop / ceiling, bytes / bandwidth) the step time is measured
against. It also reports the serial bound: the matmuls at the ceiling plus attention at
the faster of its limits, max(attention FLOPs / ceiling, K/V bytes / bandwidth), one after
the other, since in a decoder each layer's attention needs its q/k/v projections and its
output feeds the next projection, so a step cannot hide its K/V reads under its matmuls
(the weights' own reads are inside the ceiling, measured with weights from memory).
`max_fraction_of_ceiling` (matmul time / serial bound) is then the most of the matmul
ceiling a step of that shape can show: a decode step that reads much K/V is capped well
below 1 however fast its kernels are.

Each step shape runs --rounds rounds, each timing the step (median of --iters), then the
ceiling's variants and the read bandwidth once: this host's speed drifts by 15-30% over
minutes, and a ceiling measured minutes away from its step made a fraction move by as
much. Step time, ceiling and bandwidth are the medians over the rounds; each fraction and
ratio is the median of the rounds' own (the record keeps every round). Writes experiments/results/<output>.json and experiments/plots/<output>.png
(`python -m experiments.plots --only=roofline` redraws it from the record).
"""

from __future__ import annotations

import functools
import statistics

from absl import app, flags

from experiments.benchmarks.cpu_ceilings import MatmulCeiling, ReadBandwidth
from experiments.benchmarks.step_batches import build_batch, median_ms, cdiv as _cdiv
from experiments.benchmarks.step_bytes import kv_read_bytes, served_weight_bytes

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "EngineConfig.dtype values to measure.")
_DECODE_SEQS = flags.DEFINE_list("decode_seqs", ["8", "32", "64"], "Sequences per decode step (one token each).")
_PREFILL_TOKENS = flags.DEFINE_list("prefill_tokens", ["256", "1024"], "Tokens per prefill chunk.")
_PREFILL_SEQS = flags.DEFINE_integer("prefill_seqs", 1, "Sequences a prefill chunk's tokens are split over "
                                                        "(1: one prompt's chunk, as the scheduler's FCFS gives).")
_CONTEXT_LEN = flags.DEFINE_integer("context_len", 256, "Tokens in the cache of every decoding sequence "
                                                        "(the new one included).")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed steps per round (median), after one warm-up step.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Rounds per step shape: each times the step (median of --iters), then "
                                           "the ceiling's matmul variants and the read bandwidth once; a fraction "
                                           "is the median of the rounds' own fractions.")
_BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 1024, "Size of the array the read-bandwidth probe reduces.")
_OUTPUT = flags.DEFINE_string("output", "roofline", "Result name: experiments/results/<output>.json (and the plot's).")


def matmul_flops(cfg, tokens: int, logits_rows: int) -> int:
    """Projection FLOPs of `tokens` tokens through every layer, plus the LM head on `logits_rows` rows."""
    h = cfg.hidden_size
    per_token = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return 2 * (tokens * cfg.num_layers * per_token + logits_rows * h * cfg.vocab_size)


def attention_flops(cfg, q_lens, starts) -> int:
    """QK^T and PV FLOPs: each query token against the keys it sees (causal, sliding window)."""
    visible = 0
    for q_len, start in zip(q_lens, starts):
        for position in range(start, start + q_len):
            keys = position + 1
            visible += min(keys, cfg.sliding_window) if cfg.sliding_window else keys
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * visible


def serial_bound_ms(flop: float, attention_flop: float, kv_bytes: float, ceiling_gflops: float,
                    bandwidth_gbs: float) -> float:
    """The step's matmuls at the ceiling, then its attention at the faster of its compute
    and memory limits (max of the two times), added, in ms: the fastest a layer-serial step
    can run (see the module docstring)."""
    attention_ms = max(attention_flop / ceiling_gflops, kv_bytes / bandwidth_gbs) / 1e6
    return flop / ceiling_gflops / 1e6 + attention_ms


def measure_dtype(model, dtype: str, bandwidth: "ReadBandwidth", rng) -> tuple[list, list]:
    """(step rows, ceiling rows) of one engine dtype."""
    from paged_jax.entrypoints.llm import LLM
    decode, prefill = [int(s) for s in _DECODE_SEQS.value], [int(t) for t in _PREFILL_TOKENS.value]
    k, ctx, bs = _PREFILL_SEQS.value, _CONTEXT_LEN.value, _BLOCK_SIZE.value
    longest = max([ctx] + [_cdiv(t, k) for t in prefill])
    blocks = max([n * _cdiv(ctx, bs) for n in decode] + [k * _cdiv(_cdiv(t, k), bs) for t in prefill])
    max_seqs = max(decode + [k])
    llm = LLM(model, dtype=dtype, block_size=bs, max_model_len=longest, num_blocks=blocks + 1,
              max_num_seqs=max_seqs, max_num_batched_tokens=max(decode + prefill), enable_prefix_caching=False,
              seq_buckets=tuple(sorted(set(decode + [max_seqs]))), token_buckets=tuple(sorted(set(decode + prefill))))
    runner, cfg = llm.engine.runner, model.config
    weights = served_weight_bytes(runner)
    kv_itemsize = runner.kv_cache["k"].dtype.itemsize
    cases = [("decode", [1] * n, [ctx - 1] * n) for n in decode]
    cases += [("prefill", [t // k + (j < t % k) for j in range(k)], [0] * k) for t in prefill]
    probe, ceilings, rows = MatmulCeiling(cfg, dtype, rng), {}, []
    for kind, q_lens, starts in cases:
        batch = build_batch(runner, q_lens, starts, rng)
        seqs, tokens = len(q_lens), sum(q_lens)
        mm_rows = seqs if kind == "decode" else tokens
        # in turn, so that the host's drift (+-15-30% over minutes here) moves a round's step
        # and its ceilings together; each ratio below is the median of the rounds' ratios
        rounds = []
        for _ in range(_ROUNDS.value):
            step_ms = median_ms(functools.partial(runner.run_batch, batch), _ITERS.value)
            gflops = probe.round(mm_rows)
            rounds.append((step_ms, max(gflops.values()), bandwidth.gbs()))
            seen = ceilings.setdefault(mm_rows, {"rows": mm_rows, "dtype": dtype, "variants_gflops": {},
                                                 "gflops_rounds": []})
            seen["gflops_rounds"].append(round(max(gflops.values()), 1))
            for v, g in gflops.items():
                seen["variants_gflops"][v] = round(max(g, seen["variants_gflops"].get(v, 0.0)), 1)
        flop = matmul_flops(cfg, tokens, seqs)
        contexts = [s + q for q, s in zip(q_lens, starts)]
        moved = weights + kv_read_bytes(cfg, contexts, kv_itemsize)
        attention_flop = attention_flops(cfg, q_lens, starts)
        med = statistics.median
        step_ms, ceiling, gbs = (med(r[i] for r in rounds) for i in range(3))
        serial = [serial_bound_ms(flop, attention_flop, moved - weights, c, g) for _, c, g in rounds]
        bound_ms = max(flop / ceiling / 1e6, moved / gbs / 1e6)
        rows.append({
            "dtype": dtype, "kind": kind, "seqs": seqs, "tokens": tokens, "context_len": max(contexts),
            "padded_rows": batch.block_tables.shape[0], "padded_tokens": batch.token_ids.shape[0],
            "step_ms": round(step_ms, 2), "gflop": round(flop / 1e9, 3),
            "gflop_executed": round(matmul_flops(cfg, batch.token_ids.shape[0], batch.block_tables.shape[0]) / 1e9, 3),
            "attention_gflop": round(attention_flop / 1e9, 4),
            "achieved_gflops": round(flop / step_ms / 1e6, 1), "ceiling_gflops": round(ceiling, 1),
            "fraction_of_ceiling": round(med(flop / ms / 1e6 / c for ms, c, _ in rounds), 3),
            "weight_bytes": weights, "kv_read_bytes": moved - weights, "bytes_moved": moved,
            "arithmetic_intensity": round(flop / moved, 2), "achieved_gbs": round(moved / step_ms / 1e6, 2),
            "bandwidth_gbs": round(gbs, 2),
            "fraction_of_bandwidth": round(med(moved / ms / 1e6 / g for ms, _, g in rounds), 3),
            "roofline_ms": round(bound_ms, 2), "bound": "memory" if moved / gbs > flop / ceiling else "compute",
            "step_over_roofline": round(step_ms / bound_ms, 2), "serial_bound_ms": round(med(serial), 2),
            "step_over_serial_bound": round(med(r[0] / b for r, b in zip(rounds, serial)), 2),
            "max_fraction_of_ceiling": round(med(flop / r[1] / 1e6 / b for r, b in zip(rounds, serial)), 3),
            "rounds": [{"step_ms": round(ms, 2), "ceiling_gflops": round(c, 1), "bandwidth_gbs": round(g, 2)}
                       for ms, c, g in rounds]})
        r = rows[-1]
        print(f"{dtype:<9} {kind:<7} seqs {seqs:>3} tokens {tokens:>5}: {r['step_ms']:8.1f} ms  "
              f"{r['achieved_gflops']:6.0f} GFLOP/s ({r['fraction_of_ceiling']:.0%} of {ceiling:.0f})  "
              f"{r['achieved_gbs']:6.1f} GB/s ({r['fraction_of_bandwidth']:.0%} of {gbs:.1f})  "
              f"{r['step_over_roofline']:.1f}x the {r['bound']} bound, {r['step_over_serial_bound']:.2f}x the serial "
              f"bound {r['serial_bound_ms']:.1f} ms (which caps the ceiling fraction at "
              f"{r['max_fraction_of_ceiling']:.0%})", flush=True)
    for c in ceilings.values():
        c["gflops"] = round(statistics.median(c["gflops_rounds"]), 1)
        c["best_variant"] = max(c["variants_gflops"], key=c["variants_gflops"].get)
    config = llm.engine.config
    settings = {"dtype": dtype, "attention_backend": config.attention_backend, "kv_cache_dtype": config.kv_cache_dtype,
                "layer_loop": config.layer_loop, "weight_layout": runner.weight_layout}
    del llm, runner
    return [dict(r, **{k_: v for k_, v in settings.items() if k_ != "dtype"}) for r in rows], list(ceilings.values())


def main(argv):
    del argv
    import os

    import numpy as np

    from experiments import plots
    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import RESULTS_DIR, write_result
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    unknown = set(_DTYPES.value) - {"float32", "bfloat16"}
    if unknown:
        raise app.UsageError(f"unknown dtypes {sorted(unknown)}")
    longest = max([_CONTEXT_LEN.value] + [int(t) for t in _PREFILL_TOKENS.value])
    model = load_for_benchmark(_MODEL.value, longest)
    rng = np.random.default_rng(0)
    bandwidth_probe = ReadBandwidth(_BANDWIDTH_MIB.value)
    bandwidth = round(bandwidth_probe.gbs(5), 2)
    print(f"read bandwidth ({_BANDWIDTH_MIB.value} MiB max-reduce): {bandwidth:.1f} GB/s", flush=True)
    steps, ceilings = [], []
    for dtype in _DTYPES.value:
        s, c = measure_dtype(model, dtype, bandwidth_probe, rng)
        steps += s
        ceilings += c
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    figures = {"model": model.source, "bandwidth_gbs": bandwidth, "bandwidth_probe_mib": _BANDWIDTH_MIB.value,
               "steps": steps, "ceilings": ceilings, "load_average_end": os.getloadavg()}
    path = write_result(_OUTPUT.value, flags=flag_values, seed=0, figures=figures)
    print("wrote", path)
    import json
    with open(path) as f:
        print("plot:", plots.roofline(json.load(f), os.path.join(os.path.dirname(RESULTS_DIR), "plots"),
                                      name=_OUTPUT.value))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
