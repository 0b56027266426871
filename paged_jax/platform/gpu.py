"""The GPU platform (CUDA or ROCm through XLA, Pallas kernels through Triton).

Attention: the Pallas kernels, which passed their test suites natively on an H200
(`bash experiments/gpu_check.sh`); there, on SmolLM2's shapes (random weights), 64
ShareGPT-like requests in bf16 (record attention_backends_h200): Pallas 5,518 output
tok/s, the XLA decode loop 3,417, the jnp reference 2,542; in f32 the Pallas engine's 64
outputs equal the reference's. Matmuls: XLA's dot on the checkpoint's [in, out] weights.
Engine defaults: the CPU-sized ones for now; the accelerator's (a KV budget from free device
memory, 256 sequences and 8192 tokens per step) come with async scheduling.
"""

from __future__ import annotations

from paged_jax.platform.base import Platform


class GpuPlatform(Platform):
    name = "gpu"
    attention_preference = ("pallas",)
