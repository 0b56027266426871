"""Which attention implementation `attention_backend="auto"` takes on each platform.

"auto" takes the Pallas kernel wherever it is correct and at least as fast as the jnp
reference there; the choice below follows the measured ratio kernel / reference in
experiments/results/bench_kernel*.json (rerun `python -m experiments.bench_kernel` on a
platform to check it).
"""

from __future__ import annotations

# platform -> implementation, with the measurement that decided it
AUTO_BACKEND = {
    # interpret-mode ragged kernel vs jnp reference on 2 cores (experiments/results/bench_kernel.json):
    # faster at 32 sequences and on any batch with a prefill chunk, ~0.9x only on tiny decode batches
    "cpu": "pallas",
    # Triton and Mosaic lowerings pass jax.export and interpret-mode tests, but have not yet
    # run on a device (experiments/gpu_check.sh): the reference stays the default there
    "gpu": "reference",
    "tpu": "reference",
}


def auto_attention_backend(platform: str) -> str:
    """"pallas" or "reference" for a JAX platform name ("cpu", "gpu", "cuda", "rocm", "tpu")."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    return AUTO_BACKEND.get(platform, "reference")
