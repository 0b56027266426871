"""Which attention implementation `attention_backend="auto"` takes on each platform.

"auto" takes the fastest implementation that is correct on the platform, by measurement:
on CPU the C++ kernel (cpu_kernels/, built on first use) where this machine can build it,
else the Pallas kernel in interpret mode; on GPU the Pallas kernels (Triton), which passed
their test suites natively on an H200 (experiments/gpu_check.sh); on TPU the jnp
reference until the Mosaic kernels have run on one.
"""

from __future__ import annotations

# platform -> implementations in order of preference, with the measurement that decided it
AUTO_BACKEND = {
    # SmolLM2, 64 decode rows at context 256, per layer (`python -m experiments.step_profile`):
    # the native kernel reads K/V once through the block table; the XLA loop copies the
    # gathered blocks first; the Pallas kernel runs in interpret mode
    "cpu": ("native", "pallas"),
    # NVIDIA H200, SmolLM2's shapes (random weights), 64 ShareGPT-like requests, bf16
    # (`bash experiments/gpu_check.sh h200`, record attention_backends_h200): Pallas 5,518
    # output tok/s, the XLA decode loop 3,417, the jnp reference 2,542; in f32 the Pallas
    # engine's 64 outputs equal the reference's
    "gpu": ("pallas",),
    # the Mosaic kernels lower through jax.export and pass TPU interpret mode, but have not
    # yet run on a TPU
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
