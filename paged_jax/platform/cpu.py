"""The CPU platform: the native C++ kernels (cpu_kernels/, built with g++ on first use) where
this machine can build them, XLA otherwise. The only module tree that imports cpu_kernels/.

Attention: the native kernel ("native": reads K/V once through the block table, writes a
step's rows in place in f32 or bf16) where it builds, else the Pallas kernel in interpret
mode; measured on SmolLM2, 64 decode rows at context 256, per layer
(`python -m experiments.step_profile`): the XLA loop copies the gathered blocks first and
the interpreted Pallas kernel is an emulator.

Matmuls: the weight layouts of cpu_linear.py, chosen per dtype and machine
(`serving_linear`).

Defaults: the settings the CPU records measure (record `peer_vllm`, paged_jax 1.29x vLLM's
CPU backend: 64 sequences and 1024 tokens per step), and the layer loop unrolled
(LlamaDecoder's unroll_layers: XLA CPU's fast bf16 dot path misses weights sliced from a
stack inside a loop). Host work does not overlap the step: XLA's CPU threads already use
every core, and overlapping the structured-output bitmask made the step slower
(`python -m experiments.structured_outputs_overhead`, one-off: +19% overlapped against
+11% before the step, 32 rows of SmolLM2 on 2 cores).
"""

from __future__ import annotations

import jax.numpy as jnp

from cpu_kernels import amx_matmul, build, f32_matmul
from cpu_kernels.ragged_paged_attention import ragged_paged_attention_cpu
from cpu_kernels.write_kv import write_kv
from paged_jax.attention.paged_attention import PORTABLE_BACKENDS, AttentionKernels
from paged_jax.model.decoder import DecoderLayer
from paged_jax.model.functional import LAYER_MATRICES
from paged_jax.model.linear import XLA_LINEAR, XlaLinear
from paged_jax.platform.base import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineDefaults, Platform
from paged_jax.platform.cpu_linear import AMX_TILES, F32_COLUMNS, OUT_IN


class CpuPlatform(Platform):
    name = "cpu"
    attention_preference = ("native", "pallas")
    defaults = EngineDefaults(max_num_seqs=64, max_num_batched_tokens=1024,
                              kv_cache_memory_bytes=DEFAULT_KV_CACHE_MEMORY_BYTES, layer_loop="unroll")
    overlap_host_work = False
    fused_head = False  # the head as its own call: the sampler's temporaries fault pages here (step_head.py)
    # the "device" is these same cores: host work during a step competes with the step's XLA threads
    async_scheduling = False

    def available_backends(self) -> tuple[str, ...]:
        return (("native",) if build.available() else ()) + PORTABLE_BACKENDS

    def attention_kernels(self, backend: str) -> AttentionKernels:
        if backend == "native":
            return AttentionKernels(write=write_kv, attend=ragged_paged_attention_cpu)
        return super().attention_kernels(backend)

    def kv_cache_dtype(self, dtype: str, attention_backend: str) -> str:
        """The weights' dtype, except bf16 with an XLA write path: XLA's CPU scatter has no
        bf16 path, and writing a step's K/V into a bf16 cache converted the whole cache to
        f32 and back (a one-off measurement here: 256 rows into a 30-layer SmolLM2 cache took
        245 ms, against 0.02 ms in f32), so such a cache stays f32 (twice the bytes per
        block). The native backend writes rows in place in either dtype (0.02 ms)."""
        return dtype if attention_backend == "native" else "float32"

    def serving_linear(self, params, model_class, mesh) -> XlaLinear:
        """bf16 weights of the stock layers are packed for the AMX kernel where the machine
        has AMX and every matrix fits its tiles, else held [out, in]; f32 weights are packed
        in 16-column blocks for the AVX-512 FMA kernel where the machine has AVX-512 and
        every matrix's columns fit. Tensor parallelism (its shardings follow [in, out]),
        other dtypes and layer classes with their own attention or MLP (they may multiply
        their matrices any way) keep XLA's dot on [in, out]."""
        layer_class = getattr(model_class, "layer_class", None)
        layers = params.get("layers", {})
        if (mesh is not None or layer_class is None
                or layer_class.attention is not DecoderLayer.attention or layer_class.mlp is not DecoderLayer.mlp
                or not all(name in layers for name in LAYER_MATRICES)
                or layers["wq"].dtype not in (jnp.bfloat16, jnp.float32)):
            return XLA_LINEAR
        if layers["wq"].dtype == jnp.float32:
            if f32_matmul.supported() and all(f32_matmul.fits(layers[name][0]) for name in LAYER_MATRICES):
                return F32_COLUMNS
            return XLA_LINEAR
        if amx_matmul.supported() and all(amx_matmul.packable(layers[name][0]) for name in LAYER_MATRICES):
            return AMX_TILES
        return OUT_IN
