"""Where a decode step's time goes: the parts of the jitted step, timed one by one.

    python -m experiments.step_profile                        # SmolLM2-135M, batches 8 / 32 / 64
    python -m experiments.step_profile --model=tiny_llama --num_seqs=4 --iters=3   # fast

Why: on this CPU the engine's decode throughput is far below the matmul ceiling (150-217
GFLOP/s in fp32 over SmolLM2's 0.27 GFLOP per token: about 650 tok/s), and throughput
barely grows with the batch, which erases most of what paging buys. Before changing anything, measure which
part of a step costs what, and how each part grows with the batch. For each --num_seqs
(one decode token per sequence, every sequence at --context_len) this times, as
separately jitted functions with the engine's own code:

  layers_scan          the decoder (norms, q/k/v/o and MLP matmuls, RoPE) with attention
  layers_unroll        replaced by the identity, as one lax.scan over the stacked layers and
  layers_served        unrolled over per-layer arrays (layer_loop "scan" / "unroll"), and
                       unrolled in the runner's CPU serving weight layout (bf16: packed for
                       the AMX kernel where the CPU has AMX, else [out, in]; f32: packed for
                       the FMA kernel where the CPU has AVX-512, else as stored)
  attention_*          every layer's attention over a pool holding all layers' blocks (as
                       the engine's cache does, so K/V come from memory, not cache): the
                       native C++ kernel, the ragged Pallas kernel (interpret mode on CPU),
                       its jnp reference and the XLA chunked decode loop
  logits               the head matmul for the batch's rows ([S, H] x [H, V]), and (served) on
  logits_served        the native kernel (AMX for bf16, FMA for f32) on the head packed once,
                       with its per-row argmax, where the runner does that
  logprobs_top_k       log_softmax and top-K (the runner returns top-K every step)
  sample_greedy        sample_tokens with temperature 0 (the sampler before step_head.py)
  greedy_head          step_head.greedy_head: what the runner runs for an all-greedy batch
                       when the served head does not return the argmax (no packed head)
  matmul_ceiling       the fastest MLP-shaped matmul at S rows with weights from memory (XLA's
                       dot or the native kernel: experiments/benchmarks/cpu_ceilings.py, as the
                       roofline uses), scaled to the model's FLOPs per token: the step time if
                       every matmul ran at that rate

Times are medians of --iters calls after a warm-up. `step_ms_before` sums the step as the
engine ran it before the native kernels (scan, Pallas kernel, top-K every step);
`step_ms_after` as an all-greedy batch asking no logprobs runs now (unrolled in the
serving layout, native attention, the served head; its argmax is the step's tokens where the
head is packed for a native kernel, else greedy_head runs after it; top-K only when asked).
Writes
experiments/results/step_profile.json (--dtype=bfloat16: bf16 weights and KV pool).
"""

from __future__ import annotations

import functools
import statistics

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model (any load_model source) or a tiny_* preset.")
_NUM_SEQS = flags.DEFINE_list("num_seqs", ["8", "32", "64"], "Decode batch sizes.")
_CONTEXT_LEN = flags.DEFINE_integer("context_len", 256, "Tokens in the cache of every sequence.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_TOP_K = flags.DEFINE_integer("top_k", 20, "Top-K logprobs per row (EngineConfig.max_logprobs).")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed calls per part (median).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' and KV pool's dtype.")
_OUTPUT = flags.DEFINE_string("output", "step_profile", "Result name: experiments/results/<output>.json.")


def _median_ms(fn, *args, iters: int) -> float:
    from experiments.benchmarks.kernel_timing import median_seconds
    return round(median_seconds(fn, args, iters) * 1e3, 3)


def profile(model, num_seqs: int, context_len: int, block_size: int, top_k: int, iters: int,
            dtype: str = "float32") -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flax import nnx

    from experiments.benchmarks.cpu_ceilings import MatmulCeiling
    from paged_jax.attention.chunked_attention import chunked_decode_attention
    from paged_jax.model.decoder import LlamaDecoder
    from paged_jax.model.functional import layer_matrices_as, restack_layers, split_model, unstack_layers
    from paged_jax.platform import platform_named
    from paged_jax.worker.sampler import sample_tokens
    from paged_jax.worker.step_head import greedy_head
    from pallas_kernels.ragged_paged_attention import (
        ragged_paged_attention,
        ragged_paged_attention_reference,
    )
    cfg = model.config
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), model.params)
    n, rng = num_seqs, np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, n), jnp.int32)
    positions = jnp.full((n,), context_len - 1, jnp.int32)
    identity = lambda q, k, v, cache, layer, meta: (q, cache)
    graphdef, _ = split_model(LlamaDecoder, cfg)
    layers_scan = jax.jit(lambda p, i, s: nnx.merge(graphdef, p)(i, s, {}, None, identity)[0])
    layers_unroll = jax.jit(lambda p, i, s: nnx.merge(graphdef, restack_layers(p))(
        i, s, {}, None, identity, unroll_layers=True)[0])
    per_layer = unstack_layers(params)

    def compute_logits(p, h):
        return nnx.merge(graphdef, p).compute_logits(h)

    # the runner's CPU serving layout (the CPU platform's Linear): bf16 matrices packed for the AMX kernel
    # (or [out, in]), f32 ones for the FMA kernel, the head too
    cpu = platform_named("cpu")
    linear = cpu.serving_linear(params, LlamaDecoder, None)
    layout = linear.name
    served = layer_matrices_as(per_layer, linear.pack)
    head = params.get("lm_head")
    packed_head = linear.pack_head(params["embed"].T if head is None else head)

    def layers_served_fn(p, i, s):
        return nnx.merge(graphdef, restack_layers(p))(i, s, {}, None, identity, linear=linear, unroll_layers=True)[0]

    def logits_served_fn(p, head, h):
        return compute_logits(p, h) if head is None else linear.head_logits(h, head, argmax=True)
    blocks_per_seq = -(-context_len // block_size)
    num_blocks = 1 + n * blocks_per_seq  # per layer; the pool holds every layer's, as the engine's cache
    kv_shape = (cfg.num_layers * num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    k, v = (jnp.asarray(rng.normal(size=kv_shape), dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(n, cfg.num_heads, cfg.head_dim)), dtype)
    tables = jnp.asarray((1 + rng.permutation(num_blocks - 1)).reshape(n, blocks_per_seq), jnp.int32)

    def all_layers(attend):  # layer l reads its blocks: table entries offset by l * num_blocks
        def run(q, k, v, tables, lens, qsl):
            def body(layer, total):
                return total + attend(q, k, v, tables + layer * num_blocks, lens, qsl).astype(jnp.float32)
            return jax.lax.fori_loop(0, cfg.num_layers, body, jnp.zeros(q.shape, jnp.float32))
        return jax.jit(run)
    lens = jnp.full((n,), context_len, jnp.int32)
    qsl = jnp.arange(n + 1, dtype=jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(n, cfg.hidden_size)), jnp.float32)
    logits = compute_logits(params, hidden)
    keys = jax.vmap(jax.random.key)(jnp.arange(n, dtype=jnp.uint32))
    zeros, ones = jnp.zeros(n), jnp.ones(n)
    greedy = functools.partial(sample_tokens, temperature=zeros, top_k=jnp.zeros(n, jnp.int32), top_p=ones,
                               min_p=zeros)
    attention = {"native": cpu.attention_kernels("native").attend, "kernel": ragged_paged_attention,
                 "reference": ragged_paged_attention_reference,
                 "xla": functools.partial(chunked_decode_attention, otherwise=ragged_paged_attention)}
    parts = {
        "layers_scan": _median_ms(layers_scan, params, ids, positions, iters=iters),
        "layers_unroll": _median_ms(layers_unroll, per_layer, ids, positions, iters=iters),
        "layers_served": _median_ms(jax.jit(layers_served_fn), served, ids, positions, iters=iters),
        **{f"attention_{name}": _median_ms(all_layers(fn), q, k, v, tables, lens, qsl, iters=iters)
           for name, fn in attention.items()},
        "logits": _median_ms(jax.jit(compute_logits), params, hidden, iters=iters),
        "logits_served": _median_ms(jax.jit(logits_served_fn), params, packed_head, hidden, iters=iters),
        "logprobs_top_k": _median_ms(jax.jit(lambda x: jax.lax.top_k(jax.nn.log_softmax(x, -1), top_k)), logits,
                                     iters=iters),
        "sample_greedy": _median_ms(jax.jit(lambda x, kk: greedy(x, keys=kk)), logits, keys, iters=iters),
        "greedy_head": _median_ms(jax.jit(functools.partial(greedy_head, k=top_k)), logits, jnp.zeros(1, jnp.int32),
                                  iters=iters),
    }
    # the ceiling: the fastest MLP-shaped matmul variant at n rows (weights from memory), median of
    # rounds, applied to the model's matmul FLOPs per token
    ceiling = MatmulCeiling(cfg, dtype, rng)
    rounds = [ceiling.round(n) for _ in range(max(iters, 5))]
    gflops = statistics.median(max(r.values()) for r in rounds)
    fastest = statistics.mode(max(r, key=r.get) for r in rounds)
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    flops_per_token = 2 * (cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size)
    before = sum(parts[k_] for k_ in ("layers_scan", "attention_kernel", "logits", "logprobs_top_k", "sample_greedy"))
    # the runner takes an all-greedy batch's tokens from the packed head's argmax (SplitHeads.native_greedy)
    head_argmax = packed_head is not None
    after = sum(parts[k_] for k_ in ("layers_served", "attention_native", "logits_served")) \
        + (0.0 if head_argmax else parts["greedy_head"])
    return {"num_seqs": n, "context_len": context_len, "dtype": dtype, "weight_layout": layout, "parts_ms": parts,
            "served_head_argmax": head_argmax,
            "step_ms_before": round(before, 2), "tokens_per_s_before": round(n / before * 1e3, 1),
            "step_ms_after": round(after, 2), "tokens_per_s_after": round(n / after * 1e3, 1),
            "matmul_gflops": round(gflops, 1), "ceiling_variant": fastest,
            "gflop_per_token": round(flops_per_token / 1e9, 3),
            "ceiling_step_ms": round(n * flops_per_token / gflops / 1e6, 2),
            "ceiling_tokens_per_s": round(gflops * 1e9 / flops_per_token, 1)}


def main(argv):
    del argv
    import os

    from experiments.bench_models import load_for_benchmark
    from experiments.reporting.results_io import write_result
    from paged_jax.worker.compilation_cache import enable_compilation_cache
    enable_compilation_cache()
    model = load_for_benchmark(_MODEL.value, _CONTEXT_LEN.value + 1)
    rows = []
    for n in (int(s) for s in _NUM_SEQS.value):
        rows.append(profile(model, n, _CONTEXT_LEN.value, _BLOCK_SIZE.value, _TOP_K.value, _ITERS.value,
                            _DTYPE.value))
        r = rows[-1]
        print(f"batch {n:>3}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["parts_ms"].items())
              + f" ms; before {r['step_ms_before']:.1f} ms = {r['tokens_per_s_before']:.0f} tok/s, after "
              f"{r['step_ms_after']:.1f} ms = {r['tokens_per_s_after']:.0f} tok/s; ceiling "
              f"{r['ceiling_step_ms']:.1f} ms ({r['matmul_gflops']:.0f} GFLOP/s)", flush=True)
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, seed=0,
                                figures={"model": model.source, "rows": rows, "load_average_end": os.getloadavg()}))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
