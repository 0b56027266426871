"""Which weight layout makes XLA CPU's dots fastest: [in, out] or [out, in].

    python -m experiments.weight_layout             # SmolLM2's projection shapes, bf16 and f32
    python -m experiments.weight_layout --rounds=3  # faster, noisier

Why: a decode-step profile (`perf record` on the engine) showed XLA's dot library
repacking every weight matrix for AMX on every call (`ynn::interleave2_x16` took as much
time as the matmuls themselves), and the repacking of an [out, in] matrix is a cheaper
transpose. For each SmolLM2-135M projection shape and row count this times 30 distinct
weights (like 30 layers, so they come from memory, not cache) as x @ w with w [in, out]
and as a dot_general over w's last axis with w [out, in], alternating the two in
--rounds rounds (the machine's speed drifts; a paired comparison per round survives that)
and keeping each one's fastest round. Writes experiments/results/weight_layout.json; the
runner's CPU serving layout (`paged_jax.model.decoder.weights_out_in`) follows it.
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
    rows = []
    for dtype in _DTYPES.value:
        for name, (k, n) in SHAPES.items():
            weights = [jnp.asarray(rng.standard_normal((k, n)) * 0.02, dtype) for _ in range(NUM_WEIGHTS)]
            transposed = [w.T.copy() for w in weights]
            for m in map(int, _ROWS.value):
                x = jnp.asarray(rng.standard_normal((m, k)), dtype)
                jax.block_until_ready(in_out(x, weights))
                jax.block_until_ready(out_in(x, transposed))
                a, b = [], []
                for _ in range(_ROUNDS.value):
                    a.append(_seconds(in_out, x, weights))
                    b.append(_seconds(out_in, x, transposed))
                flop = 2 * m * k * n * NUM_WEIGHTS
                row = {"dtype": dtype, "shape": name, "rows": m,
                       "in_out_ms_per_dot": round(1e3 * min(a) / NUM_WEIGHTS, 4),
                       "out_in_ms_per_dot": round(1e3 * min(b) / NUM_WEIGHTS, 4),
                       "in_out_gflops": round(flop / min(a) / 1e9, 1), "out_in_gflops": round(flop / min(b) / 1e9, 1),
                       "speedup": round(min(a) / min(b), 3),
                       "rounds_out_in_faster": sum(y < z for z, y in zip(a, b)), "rounds": _ROUNDS.value}
                rows.append(row)
                print(f"{dtype:<9} {name:<18} rows {m:<5} [in,out] {row['in_out_gflops']:6.0f} GFLOP/s  "
                      f"[out,in] {row['out_in_gflops']:6.0f} GFLOP/s  x{row['speedup']:.2f} "
                      f"({row['rounds_out_in_faster']}/{row['rounds']} rounds faster)", flush=True)
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(__name__)}
    print("wrote", write_result(_OUTPUT.value, flags=flag_values, figures={"rows": rows}))


if __name__ == "__main__":
    app.run(main)
