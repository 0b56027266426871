"""The platform layer: one object per device kind (cpu.py, gpu.py, tpu.py; base.py says
what a platform decides), so that what differs between CPU, GPU and TPU lives here and is
handed down explicitly to the model and attention layers."""

from __future__ import annotations

from paged_jax.platform.base import EngineDefaults, Platform

__all__ = ["EngineDefaults", "Platform", "current_platform", "platform_named"]


def platform_named(name: str) -> Platform:
    """The platform of a JAX platform name ("cpu", "gpu", "cuda", "rocm", "tpu"; any other
    gets the portable base behaviour). The CPU one is imported only when asked for, so an
    accelerator process never loads cpu_kernels/."""
    name = {"cuda": "gpu", "rocm": "gpu"}.get(name, name)
    if name == "cpu":
        from paged_jax.platform.cpu import CpuPlatform
        return CpuPlatform()
    if name == "gpu":
        from paged_jax.platform.gpu import GpuPlatform
        return GpuPlatform()
    if name == "tpu":
        from paged_jax.platform.tpu import TpuPlatform
        return TpuPlatform()
    portable = Platform()  # another JAX backend: the portable kernels, XLA's dot, the base defaults
    portable.name = name
    return portable


def current_platform() -> Platform:
    """The platform of JAX's default backend (what the engine's arrays live on)."""
    import jax
    return platform_named(jax.default_backend())
