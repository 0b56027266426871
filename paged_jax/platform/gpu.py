"""The GPU platform (CUDA or ROCm through XLA, Pallas kernels through Triton).

Attention: the Pallas kernels, which passed their test suites natively on an H200
(`bash experiments/gpu_check.sh`); there, on SmolLM2's shapes (random weights), 64
ShareGPT-like requests in bf16 (record attention_backends_h200): Pallas 5,518 output
tok/s, the XLA decode loop 3,417, the jnp reference 2,542; in f32 the Pallas engine's 64
outputs equal the reference's. Matmuls: XLA's dot on the checkpoint's [in, out] weights.
Engine defaults: the accelerator's (base.ACCELERATOR_DEFAULTS): 256 sequences and 8192 tokens
per step, the KV cache gpu_memory_utilization (0.9) of the memory free once the weights are
loaded, async scheduling on.
"""

from __future__ import annotations

from paged_jax.platform.base import ACCELERATOR_DEFAULTS, Platform


class GpuPlatform(Platform):
    name = "gpu"
    attention_preference = ("pallas",)
    defaults = ACCELERATOR_DEFAULTS
