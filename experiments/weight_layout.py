"""Which weight layout makes CPU matmuls fastest: [in, out], [out, in], or packed once for a native kernel.

    python -m experiments.weight_layout             # SmolLM2's projection shapes, bf16 and f32
    python -m experiments.weight_layout --rounds=3  # faster, noisier

Why: a decode-step profile (`perf record` on the engine) showed XLA's dot library
repacking every weight matrix for AMX on every call (`ynn::interleave2_x16` took as much
time as the matmuls themselves), and the repacking of an [out, in] matrix is a cheaper
transpose; packing once (cpu_kernels/amx_matmul.cc, bf16 on AMX machines) removes it. For
each SmolLM2-135M projection shape and row count this times 30 distinct weights (like 30
layers, so they come from memory, not cache) as x @ w with w [in, out], as a dot_general
over w's last axis with w [out, in], (bf16, where AMX runs) as the AMX kernel on packed
weights, and (f32, where AVX-512 runs) as the FMA kernel on 16-column blocks
(cpu_kernels/f32_matmul.cc), alternating them in --rounds rounds (the machine's speed drifts; a paired
comparison per round survives that) and keeping each one's fastest round. Writes
experiments/results/weight_layout.json; the runner's CPU serving layout
(`paged_jax.model.decoder.weight_layout`) follows it.
"""

from __future__ import annotations

import time

from absl import app, flags

_ROWS = flags.DEFINE_list("rows", ["64", "1024"], "Rows of x (tokens in the step).")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Alternating rounds per shape (each: both layouts once).")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Weight dtypes.")
_OUTPUT = flags.DEFINE_string("output", "weight_layout", "Result name: experiments/results/<output>.json.")

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query heads and 3 KV heads of 64
SHAPES = {"q/o 576->576": (576, 576), "k/v 576->192": (576, 192), "gate/up 576->1536": (576, 1536),
          "down 1536->576": (1536, 576)}
NUM_WEIGHTS = 30


def _seconds(fn, *args, calls: int = 5) -> float:
    import jax
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.reporting.results_io import write_result
    rng = np.random.default_rng(0)
    in_out = jax.jit(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws])
    out_in = jax.jit(lambda x, ws: [jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                        preferred_element_type=jnp.float32) for w in ws])
    from cpu_kernels import amx_matmul, f32_matmul
    amx = jax.jit(lambda x, ws: [amx_matmul.amx_matmul(x, w) for w in ws])
    fma = jax.jit(lambda x, ws: [f32_matmul.f32_matmul(x, w) for w in ws])
    rows = []
    for dtype in _DTYPES.value:
        for name, (k, n) in SHAPES.items():
            weights = [jnp.asarray(rng.standard_normal((k, n)) * 0.02, dtype) for _ in range(NUM_WEIGHTS)]
            variants = {"in_out": (in_out, weights), "out_in": (out_in, [w.T.copy() for w in weights])}
            if dtype == "bfloat16" and amx_matmul.supported():
                variants["amx_tiles"] = (amx, [amx_matmul.pack_weights(w) for w in weights])
            if dtype == "float32" and f32_matmul.supported():
                variants["f32_columns"] = (fma, [f32_matmul.pack_columns(w) for w in weights])
            for m in map(int, _ROWS.value):
                x = jnp.asarray(rng.standard_normal((m, k)), dtype)
                for fn, ws in variants.values():
                    jax.block_until_ready(fn(x, ws))
                times = {v: [] for v in variants}
                for _ in range(_ROUNDS.value):
                    for v, (fn, ws) in variants.items():
                        times[v].append(_seconds(fn, x, ws))
                flop = 2 * m * k * n * NUM_WEIGHTS
                row = {"dtype": dtype, "shape": name, "rows": m, "rounds": _ROUNDS.value}
                for v, t in times.items():
                    row[f"{v}_ms_per_dot"] = round(1e3 * min(t) / NUM_WEIGHTS, 4)
                    row[f"{v}_gflops"] = round(flop / min(t) / 1e9, 1)
                row["out_in_speedup"] = round(min(times["in_out"]) / min(times["out_in"]), 3)
                row["rounds_out_in_faster"] = sum(b < a for a, b in zip(times["in_out"], times["out_in"]))
                if "amx_tiles" in times:
                    row["amx_tiles_speedup_over_out_in"] = round(min(times["out_in"]) / min(times["amx_tiles"]), 3)
                if "f32_columns" in times:
                    row["f32_columns_speedup_over_in_out"] = round(min(times["in_out"]) / min(times["f32_columns"]), 3)
                rows.append(row)
                print(f"{dtype:<9} {name:<18} rows {m:<5} " + "  ".join(
                    f"{v} {row[v + '_gflops']:6.0f}" for v in times) + " GFLOP/s", flush=True)
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures={"rows": rows}))


if __name__ == "__main__":
    app.run(main)
