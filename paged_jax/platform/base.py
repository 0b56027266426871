"""Platform: everything that differs between CPU, GPU and TPU, in one object.

The engine's layers above (worker, engine) ask the platform; the layers below (model,
attention) are handed what it chose, as arguments. So a GPU or TPU reader never meets the
CPU's AVX-512 code paths, and a new device is one new subclass: which attention kernels
"auto" means, how the layers multiply by their weights and how those are laid out
(`serving_linear`), which KV cache dtype "auto" means, whether host work may overlap the
device step, whether the sampling head runs inside the step (`fused_head`), and the engine
settings a user gets by default (`EngineDefaults`). vLLM's `vllm/platforms/` is the model
for this split.

Subclasses: cpu.py (the only importer of cpu_kernels/), gpu.py, tpu.py; `current_platform()`
in __init__.py picks one for JAX's default backend.
"""

from __future__ import annotations

import dataclasses

from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES
from paged_jax.attention.paged_attention import PORTABLE_BACKENDS, AttentionKernels, portable_kernels
from paged_jax.model.linear import XLA_LINEAR, XlaLinear


@dataclasses.dataclass(frozen=True)
class EngineDefaults:
    """What EngineConfig fields left None become on a platform (engine/kv_sizing.resolve_config)."""

    max_num_seqs: int  # sequences per step
    max_num_batched_tokens: int  # tokens per step
    kv_cache_memory_bytes: int  # KV budget when neither num_blocks nor kv_cache_memory_bytes is given
    layer_loop: str  # "unroll" | "scan" (LlamaDecoder's unroll_layers says why it matters)
    # True: that budget is instead EngineConfig.gpu_memory_utilization of the device's free memory once the
    # weights are loaded (vLLM's rule: an accelerator serves best with the largest cache it can hold, and its
    # memory holds nothing else), with kv_cache_memory_bytes the fallback where the device keeps no memory
    # statistics. False (CPU): the fixed budget, since host memory is shared with everything else the host runs
    kv_from_free_memory: bool = False

    def __post_init__(self):
        if self.layer_loop not in ("unroll", "scan"):
            raise ValueError(f"layer_loop must be 'unroll' or 'scan', got {self.layer_loop!r}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.kv_cache_memory_bytes) < 1:
            raise ValueError(f"engine defaults must be positive, got {self}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must cover max_num_seqs (a token per running sequence)")


# GPU and TPU (vLLM's defaults there): a step of 256 sequences and 8192 tokens keeps a device busy where a
# CPU-sized step (32 / 256) left it waiting on the host, and the KV cache takes the free device memory. At
# these sizes the default buckets are 12 sequence counts and 19 token counts, and warm-up compiles 22 step
# programs (engine_config.default_buckets, worker/batch_inputs.all_batch_shapes), against 16 at the CPU's
ACCELERATOR_DEFAULTS = EngineDefaults(max_num_seqs=256, max_num_batched_tokens=8192,
                                      kv_cache_memory_bytes=DEFAULT_KV_CACHE_MEMORY_BYTES, layer_loop="scan",
                                      kv_from_free_memory=True)


class Platform:
    """The portable behaviour: XLA's dot on [in, out] weights, the portable attention
    backends (paged_jax/attention/paged_attention.py), the weights' dtype for the KV cache.
    Subclasses set `name`, `attention_preference`, `defaults` and override what differs."""

    name: str = ""  # JAX's platform name: "cpu" | "gpu" | "tpu"
    # attention backends in order of preference: "auto" takes the first one available here
    attention_preference: tuple[str, ...] = ("reference",)
    defaults: EngineDefaults = EngineDefaults(max_num_seqs=32, max_num_batched_tokens=256,
                                              kv_cache_memory_bytes=DEFAULT_KV_CACHE_MEMORY_BYTES, layer_loop="scan")
    # host work (the structured-output bitmask) while the dispatched step runs: worth it where the
    # device computes and the host waits; not where the step itself runs on the host's cores
    overlap_host_work: bool = True
    # the sampling head inside the jitted model step (one dispatch per step, the logits never leave
    # the device) rather than a jitted call of its own after it: a second dispatch and host round trip
    # per step cost the most where a device computes and the host waits; the CPU splits them
    # (paged_jax/worker/step_head.py says why that measured faster there)
    fused_head: bool = True
    # async scheduling (EngineConfig.async_scheduling's default): the host schedules and prepares
    # step N+1 and reads step N's tokens while N+1 runs, so the device does not wait on the host
    async_scheduling: bool = True

    def local_devices(self, count: int) -> list:
        """The first `count` of this process's devices: the ones the KV cache is sized for and
        checked against (their `memory_stats()`, engine/kv_sizing.py)."""
        import jax
        return jax.local_devices()[:count]

    def available_backends(self) -> tuple[str, ...]:
        """The attention backends that run here."""
        return PORTABLE_BACKENDS

    def auto_attention_backend(self) -> str:
        """What attention_backend="auto" means here: the first preferred backend available."""
        available = self.available_backends()
        return next((b for b in self.attention_preference if b in available), "reference")

    def resolve_attention_backend(self, requested: str) -> str:
        """`requested` ("auto" or a backend name) as a backend that runs here; a ValueError
        naming the ones that do otherwise."""
        backend = self.auto_attention_backend() if requested == "auto" else requested
        if backend not in self.available_backends():
            raise ValueError(f"attention_backend={backend!r} does not run on this {self.name} machine; available "
                             f"here: {self.available_backends()} (or 'auto')")
        return backend

    def attention_kernels(self, backend: str) -> AttentionKernels:
        """The cache write and attention kernel of a (resolved) backend."""
        return portable_kernels(backend, self.name)

    def kv_cache_dtype(self, dtype: str, attention_backend: str) -> str:
        """What kv_cache_dtype="auto" means for weights in `dtype`: the same dtype."""
        del attention_backend
        return dtype

    def serving_linear(self, params, model_class, mesh) -> XlaLinear:
        """How the runner's step multiplies by the layers' matrices (and so how it holds
        them: `Linear.pack`): XLA's dot on [in, out]."""
        del params, model_class, mesh
        return XLA_LINEAR
