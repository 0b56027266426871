"""Paged-attention kernels against the jnp reference and dense attention.

    python -m experiments.bench_kernel                         # SmolLM2's shape, a small sweep
    python -m experiments.bench_kernel --num_seqs=8,32 --context_len=512,2048 --backend=gpu
    python -m experiments.bench_kernel --backend=gpu --tunings=c64-w4,c128-w8 --upstream --ceilings \
        --prefill_q_len=512 --inner=50          # a GPU sweep (experiments/gpu_check.sh)
    python -m experiments.bench_kernel --backend=gpu --kernels=paged_attention --tunings=c64,c128-k2 ...
                                                # the decode kernel (and dense) only

Every list flag takes comma-separated values; the run sweeps their product. For each
decode point: the decode kernel (`paged_attention`), the ragged kernel on one query per
sequence (`ragged_paged_attention`), their jnp references (gather through the block
table, then dense softmax), and dense attention over contiguous K/V of the same lengths
(the same math with no block table: the kernel's upper bound); with --tunings, both
kernels once per TritonTuning label (`<kernel>@<label>`), with --upstream JAX's own
Pallas GPU kernel. With --prefill_q_len, each point also runs prefill chunks of that
many tokens at the end of the context (ragged kernel, reference, dense causal). With
--ceilings, the device's memory bandwidth and bf16 matmul rate are measured first, and
every row gets its fraction of them. Times are medians of --iters samples after warm-up,
the kernels of a point timed in turn; with --inner > 1 a sample is --inner calls chained
in one jitted loop on the device (each call's query the previous call's output), over
--inner: the host dispatches once per sample, which matters for kernels under 0.1 ms
(experiments/benchmarks/kernel_timing.py; the record's figures.timing has a trivial op's
time per call dispatched one by one and chained). GB/s counts the K/V bytes each call
must read. Writes experiments/results/bench_kernel[_<tag>].json.
"""

from __future__ import annotations

import itertools

from absl import app, flags

_BLOCK_SIZE = flags.DEFINE_list("block_size", ["16"], "Tokens per KV block.")
_NUM_SEQS = flags.DEFINE_list("num_seqs", ["8", "32"], "Sequences in the batch (one query each).")
_CONTEXT_LEN = flags.DEFINE_list("context_len", ["512", "2048"], "Context length of every sequence.")
_NUM_HEADS = flags.DEFINE_list("num_heads", ["9"], "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_list("num_kv_heads", ["3"], "Key/value heads (zipped with --num_heads).")
_HEAD_DIM = flags.DEFINE_list("head_dim", ["64"], "Head dimension (zipped with --num_heads).")
_DTYPE = flags.DEFINE_list("dtype", ["float32"], "float32 and/or bfloat16.")
_BACKEND = flags.DEFINE_string("backend", None, "cpu, gpu or tpu (default: JAX's default backend).")
_TUNINGS = flags.DEFINE_list("tunings", [], "TritonTuning labels to sweep (e.g. c64-r16-w4-s2,c128-w8): both "
                                            "kernels once per label, beside the defaults.")
_KERNELS = flags.DEFINE_list("kernels", ["paged_attention", "paged_attention_reference", "ragged_paged_attention",
                                           "ragged_paged_attention_reference"],
                              "Decode kernels to time (dense attention always runs; --tunings apply to the two "
                              "Pallas kernels among them).")
_UPSTREAM = flags.DEFINE_boolean("upstream", False, "Also time JAX's own Pallas GPU paged attention (GPU only).")
_PREFILL_Q_LEN = flags.DEFINE_list("prefill_q_len", [], "Also time prefill chunks of these lengths per point.")
_PREFILL_NUM_SEQS = flags.DEFINE_integer("prefill_num_seqs", 4, "Sequences in a prefill point.")
_CEILINGS = flags.DEFINE_boolean("ceilings", False, "Measure the device's memory bandwidth and bf16 matmul rate.")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed samples per measurement (median reported).")
_INNER = flags.DEFINE_integer("inner", 1, "Calls per sample, chained in one jitted loop when > 1 (their mean "
                                        "is the sample).")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the results file name (e.g. the device).")
_SEED = flags.DEFINE_integer("seed", 0, "Data seed.")


def _fmt(entry) -> str:
    if entry is None:
        return "       -"
    return f"{entry['ms']:8.3f}" if "ms" in entry else "   error"


def main(argv):
    del argv
    import jax

    from experiments.benchmarks.device_ceilings import matmul_rate, memory_bandwidth
    from experiments.benchmarks.kernel_timing import KERNELS, UNROLL, call_floor, decode_point, prefill_point
    from experiments.reporting.results_io import write_result
    from pallas_kernels.triton_tuning import TritonTuning
    backend = _BACKEND.value or jax.default_backend()
    device = jax.devices()[0]  # the default device; `backend` picks the kernels (gpu ones interpret on CPU)
    tunings = [TritonTuning.parse(label) for label in _TUNINGS.value]
    ints = lambda values: [int(x) for x in values]
    if not len(_NUM_HEADS.value) == len(_NUM_KV_HEADS.value) == len(_HEAD_DIM.value):
        raise app.UsageError("--num_heads, --num_kv_heads and --head_dim are zipped: give each as many values")
    kernels = tuple(_KERNELS.value)
    if not set(kernels) <= set(KERNELS) - {"dense"}:
        raise app.UsageError(f"--kernels takes names among {[k for k in KERNELS if k != 'dense']}")
    shapes = list(zip(ints(_NUM_HEADS.value), ints(_NUM_KV_HEADS.value), ints(_HEAD_DIM.value)))
    figures = {"backend": backend, "device": device.device_kind, "tunings": [t.label() for t in tunings]}
    timing = dict(iters=_ITERS.value, seed=_SEED.value, inner=_INNER.value)
    figures["timing"] = {"iters": _ITERS.value, "inner": _INNER.value, "interleaved": True,
                         "chained": _INNER.value > 1, "calls_per_trip": UNROLL if _INNER.value > 1 else None,
                         "decode_dense_kv": "head-major"}
    if backend == "gpu":
        figures["timing"]["trivial_op"] = call_floor(_ITERS.value, _INNER.value)
        print(f"timing: a trivial op per call, dispatched one by one / chained: "
              f"{figures['timing']['trivial_op']} ms", flush=True)
    if _CEILINGS.value:
        figures["ceilings"] = {"memory": memory_bandwidth(device, 2 * 2**30, _ITERS.value, _INNER.value),
                               "matmul_bf16": matmul_rate(device, 8192, "bfloat16", _ITERS.value, _INNER.value)}
        print(f"ceilings: memory {figures['ceilings']['memory']['GB_per_s']} GB/s, bf16 matmul "
              f"{figures['ceilings']['matmul_bf16']['TFLOP_per_s']} TFLOP/s", flush=True)
    bandwidth = figures.get("ceilings", {}).get("memory", {}).get("GB_per_s")
    rows, prefill = [], []
    name = "bench_kernel" + (f"_{_TAG.value}" if _TAG.value else "")
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    for block_size, num_seqs, context_len, (heads, kv_heads, head_dim), dtype in itertools.product(
            ints(_BLOCK_SIZE.value), ints(_NUM_SEQS.value), ints(_CONTEXT_LEN.value), shapes, _DTYPE.value):
        r = decode_point(backend, block_size, num_seqs, context_len, heads, kv_heads, head_dim, dtype,
                         kernels=kernels, tunings=tunings, upstream=_UPSTREAM.value and backend == "gpu",
                         **timing)
        if bandwidth:
            for entry in r.values():
                if isinstance(entry, dict) and "GB_per_s" in entry:
                    entry["fraction_of_bandwidth"] = round(entry["GB_per_s"] / bandwidth, 3)
        rows.append(r)
        print(f"bs={block_size:>3} seqs={num_seqs:>3} ctx={context_len:>5} h={heads}/{kv_heads}x{head_dim} "
              f"{dtype:>8}: kernel {_fmt(r.get('paged_attention'))} ms  ragged {_fmt(r.get('ragged_paged_attention'))} ms  "
              f"reference {_fmt(r.get('paged_attention_reference'))} ms  dense {_fmt(r['dense'])} ms  kernel/dense "
              f"{r.get('paged_attention_over_dense')}  ragged/dense {r.get('ragged_paged_attention_over_dense')}",
              flush=True)
        for q_len in ints(_PREFILL_Q_LEN.value):
            if q_len > context_len:
                continue
            p = prefill_point(backend, block_size, _PREFILL_NUM_SEQS.value, q_len, context_len, heads, kv_heads,
                              head_dim, dtype, tunings=tunings, **timing)
            prefill.append(p)
            print(f"   prefill {_PREFILL_NUM_SEQS.value}x{q_len} of {context_len}: ragged "
                  f"{_fmt(p['ragged_paged_attention'])} ms  reference {_fmt(p['ragged_paged_attention_reference'])} "
                  f"ms  dense {_fmt(p['dense'])} ms", flush=True)
        # after each point, so that a run cut short by its time limit keeps what it measured
        # (marked "incomplete": the points are fewer than the flags' grid)
        write_result(name, flags=flag_values, figures={**figures, "points": rows, "prefill_points": prefill,
                                                       "incomplete": True}, seed=_SEED.value)
    figures.update(points=rows, prefill_points=prefill)
    print("wrote", write_result(name, flags=flag_values, figures=figures, seed=_SEED.value))


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
