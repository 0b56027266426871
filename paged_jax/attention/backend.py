"""Which attention implementation `attention_backend="auto"` takes on each platform.

"auto" takes the fastest implementation that is correct on the platform, by measurement:
on CPU the C++ kernel (cpu_kernels/, built on first use) where this machine can build it,
else the Pallas kernel in interpret mode; on GPU and TPU the jnp reference until the
Pallas kernels have passed natively there (experiments/gpu_check.sh).
"""

from __future__ import annotations

# platform -> implementations in order of preference, with the measurement that decided it
AUTO_BACKEND = {
    # SmolLM2, 64 decode rows at context 256, per layer (`python -m experiments.step_profile`):
    # the native kernel reads K/V once through the block table; the XLA loop copies the
    # gathered blocks first; the Pallas kernel runs in interpret mode
    "cpu": ("native", "pallas"),
    # Triton and Mosaic lowerings pass jax.export and interpret-mode tests, but have not yet
    # run on a device (experiments/gpu_check.sh): the reference stays the default there
    "gpu": ("reference",),
    "tpu": ("reference",),
}


def auto_attention_backend(platform: str) -> str:
    """The backend "auto" means on a JAX platform ("cpu", "gpu", "cuda", "rocm", "tpu")."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    for backend in AUTO_BACKEND.get(platform, ("reference",)):
        if backend != "native" or _native_available():
            return backend
    return "reference"


def _native_available() -> bool:
    from cpu_kernels import build
    return build.available()
