"""This CPU's limits a served step is judged against, measured in the step's own process.

MatmulCeiling: the fastest matmul this machine has at a given row count, on MLP-shaped
weights that come from memory (every variant the engine could serve with, so a ceiling
never sits below the kernel it judges). ReadBandwidth: the rate a jitted reduce reads a
large array. experiments/roofline.py bounds whole steps with both; experiments/step_profile.py
scales its per-token matmul FLOPs by the ceiling.
"""

from __future__ import annotations

import time


class MatmulCeiling:
    """The matmul ceiling of one dtype: MLP-shaped matmuls ([rows, H] x [H, I] and [rows, I]
    x [I, H]) with num_layers distinct weights of each, so they come from memory, in every
    variant this machine has: float32 XLA's jnp.dot and the FMA kernel on 16-column blocks
    (cpu_kernels/f32_matmul.py, where supported); bfloat16 XLA's bf16 x bf16 -> f32 dot on
    [in, out] and [out, in] weights and the AMX kernel on packed weights
    (cpu_kernels/amx_matmul.py, where supported). The weights are built once; `round(rows)`
    times each variant once, so the ceiling is measured in turn with the steps it bounds."""

    def __init__(self, cfg, dtype: str, rng):
        import jax
        import jax.numpy as jnp

        from cpu_kernels import amx_matmul, f32_matmul
        h, i, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        self.shape, self.dtype, self.rng, self.inputs = (h, i, n), dtype, rng, {}
        ups = [jnp.asarray(rng.standard_normal((h, i)) * 0.02, dtype) for _ in range(n)]
        downs = [jnp.asarray(rng.standard_normal((i, h)) * 0.02, dtype) for _ in range(n)]

        def dots(dot):
            return jax.jit(lambda x, xi, ups, downs: [dot(x, w) for w in ups] + [dot(xi, w) for w in downs])
        self.variants = {"xla_in_out": (dots(lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32)),
                                        ups, downs)}
        if dtype == "bfloat16":
            out_in = dots(lambda a, w: jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())),
                                                           preferred_element_type=jnp.float32))
            self.variants["xla_out_in"] = (out_in, [w.T.copy() for w in ups], [w.T.copy() for w in downs])
            if amx_matmul.supported() and amx_matmul.packable(ups[0]) and amx_matmul.packable(downs[0]):
                self.variants["amx_tiles"] = (dots(amx_matmul.amx_matmul), [amx_matmul.pack_weights(w) for w in ups],
                                              [amx_matmul.pack_weights(w) for w in downs])
        if dtype == "float32" and f32_matmul.supported() and f32_matmul.fits(ups[0]) and f32_matmul.fits(downs[0]):
            self.variants["f32_columns"] = (dots(f32_matmul.f32_matmul), [f32_matmul.pack_columns(w) for w in ups],
                                            [f32_matmul.pack_columns(w) for w in downs])

    def flop(self, rows: int) -> int:
        h, i, n = self.shape
        return 2 * rows * h * i * 2 * n

    def round(self, rows: int) -> dict:
        """GFLOP/s of each variant at `rows` rows, one timed call each (the first call at a
        new row count compiles and warms up first)."""
        import jax
        import jax.numpy as jnp
        if rows not in self.inputs:
            h, i, _ = self.shape
            self.inputs[rows] = [jnp.asarray(self.rng.standard_normal((rows, k)), self.dtype) for k in (h, i)]
            for fn, u, d in self.variants.values():
                jax.block_until_ready(fn(*self.inputs[rows], u, d))
        out = {}
        for v, (fn, u, d) in self.variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*self.inputs[rows], u, d))
            out[v] = self.flop(rows) / (time.perf_counter() - start) / 1e9
        return out


class ReadBandwidth:
    """GB/s of a jitted max-reduce over a float32 array of `mib` MiB (the array built once)."""

    def __init__(self, mib: int):
        import jax
        import jax.numpy as jnp
        self.array = jax.block_until_ready(jax.jit(lambda: jnp.arange(mib * 2**18, dtype=jnp.float32))())
        self.reduce = jax.jit(jnp.max)
        jax.block_until_ready(self.reduce(self.array))

    def gbs(self, iters: int = 3) -> float:
        """The fastest of `iters` calls."""
        import jax
        best = float("inf")
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(self.reduce(self.array))
            best = min(best, time.perf_counter() - start)
        return self.array.nbytes / best / 1e9
