"""The two ceilings a kernel is judged against, measured on the device it runs on.

A paged-attention decode reads every K/V byte once and does little arithmetic: its
floor is the bytes over the memory bandwidth. A prefill chunk does many multiply-adds
per byte: its floor is the flops over the matrix units' rate. Datasheet figures are
leads; these are measured in the same process as the kernels: a device-to-device
elementwise pass over a large array (bytes read + bytes written over its time) and a
large bf16 matrix product with f32 accumulation.
"""

from __future__ import annotations


def memory_bandwidth(device, num_bytes: int, iters: int = 10, inner: int = 1) -> dict:
    """GB/s of `x + 1` over an f32 array of num_bytes (read once, written once)."""
    import jax
    import jax.numpy as jnp

    from experiments.benchmarks.kernel_timing import median_seconds
    with jax.default_device(device):
        x = jax.random.normal(jax.random.key(0), (num_bytes // 4,), jnp.float32)
    seconds = median_seconds(jax.jit(lambda a: a + 1), (x,), iters, inner)
    return {"bytes_moved": 2 * x.nbytes, "ms": round(seconds * 1e3, 4),
            "GB_per_s": round(2 * x.nbytes / seconds / 1e9, 1)}


def matmul_rate(device, size: int, dtype: str = "bfloat16", iters: int = 10, inner: int = 1) -> dict:
    """TFLOP/s of a size^3 product of `dtype` inputs accumulated in f32 (random inputs)."""
    import jax
    import jax.numpy as jnp

    from experiments.benchmarks.kernel_timing import median_seconds
    dt = jnp.dtype(dtype)
    with jax.default_device(device):
        a, b = (jax.random.normal(jax.random.key(i), (size, size), dt) for i in (1, 2))
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    seconds = median_seconds(dot, (a, b), iters, inner)
    return {"size": size, "dtype": dtype, "ms": round(seconds * 1e3, 4),
            "TFLOP_per_s": round(2 * size ** 3 / seconds / 1e12, 1)}
