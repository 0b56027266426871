"""How big the KV cache is, and whether the requests an engine accepts can fit in it.

Settled once when the engine core starts (what was left open in EngineConfig, from the
model and the platform) and checked per request, so that nothing is accepted that could
never run to completion: a request whose sequences cannot all be in the cache at once
would preempt itself forever.
"""

from __future__ import annotations

import dataclasses

import jax

from paged_jax.attention.backend import auto_attention_backend
from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES, DEFAULT_MAX_MODEL_LEN, EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.worker.kv_cache import bytes_per_block


def auto_kv_cache_dtype(dtype: str, platform: str, attention_backend: str) -> str:
    """The KV cache's dtype for kv_cache_dtype="auto": the weights' dtype, except bf16 on
    CPU with an XLA write path: XLA has no native bf16 scatter, and writing a step's K/V
    into a bf16 cache converted the whole cache to f32 and back (a one-off measurement here:
    256 rows into a 30-layer SmolLM2 cache took 245 ms, against 0.02 ms in f32), so such a cache stays f32 (twice the
    bytes per block). The "native" backend writes rows in place in either dtype
    (cpu_kernels/write_kv.cc; 0.02 ms for the same write in that measurement)."""
    if platform == "cpu" and attention_backend != "native":
        return "float32"
    return dtype


def resolve_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """Fill what was left open from the model and the platform: max_model_len,
    num_blocks, the attention backend behind "auto" and the KV cache's dtype."""
    model_limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {model_limit}")
    platform = jax.default_backend()
    backend = config.attention_backend
    if backend == "auto":
        backend = auto_attention_backend(platform)
    if backend == "native" and platform != "cpu":
        raise ValueError(f"attention_backend='native' is the CPU kernel (cpu_kernels/); this is a {platform} "
                         "machine: use 'pallas' or 'reference'")
    kv_dtype = config.kv_cache_dtype
    if kv_dtype == "auto":
        kv_dtype = auto_kv_cache_dtype(config.dtype, platform, backend)
    num_blocks = config.num_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        num_blocks = budget // bytes_per_block(model_config, config.block_size, kv_dtype,
                                               config.tensor_parallel_size)  # the budget is per device
    layer_loop = config.layer_loop
    if layer_loop == "auto":  # unrolled on CPU: XLA CPU's fast bf16 dots (decoder.py, unroll_layers)
        layer_loop = "unroll" if platform == "cpu" else "scan"
    return dataclasses.replace(config, max_model_len=max_model_len, num_blocks=max(int(num_blocks), 2),
                               attention_backend=backend, kv_cache_dtype=kv_dtype, layer_loop=layer_loop)


def check_capacity(config: EngineConfig, bm) -> None:
    """The cache must hold one max_model_len sequence (beyond the admission watermark),
    or a long request could wait forever."""
    fits_blocks = bm.num_usable_blocks - bm.watermark_blocks
    if bm.num_blocks_needed(config.max_model_len) > fits_blocks:
        raise ValueError(
            f"the KV cache ({config.num_blocks} blocks of {config.block_size} tokens, {bm.watermark_blocks} kept "
            f"free as watermark) cannot hold one sequence of max_model_len={config.max_model_len} tokens; the "
            f"largest max_model_len that fits is {max(fits_blocks, 0) * config.block_size} (or raise "
            "num_blocks / kv_cache_memory_bytes)")


def check_group_fits(config: EngineConfig, bm, num_seqs: int, num_tokens: int) -> None:
    """A request's sequences must fit the cache together with nothing shared, or it
    could never finish (its own sequences would preempt each other forever)."""
    tokens = min(num_tokens, config.max_model_len)
    needed = num_seqs * bm.num_blocks_needed(tokens)
    if needed > bm.num_usable_blocks - bm.watermark_blocks:
        raise ValueError(f"{num_seqs} sequences of up to {tokens} tokens "
                         f"need {needed} KV blocks; the cache has {bm.num_usable_blocks - bm.watermark_blocks}"
                         " (lower n / beam_width / max_tokens, or raise num_blocks)")
