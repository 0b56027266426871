"""The paged KV cache on device: sizing, creation and block copies (copy-on-write).

K/V writes at the slots and attention through the block tables are in
`paged_jax/attention/paged_attention.py`.

Layout: {"k", "v"}, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim];
layer l's slice is the public per-layer layout the kernels take. Block 0 is the null
block that padding points at. A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`; padded tokens carry slot
`num_blocks * block_size`, which the scatter drops.
"""

from __future__ import annotations

import jax.numpy as jnp

from paged_jax.config.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype, tensor_parallel_size: int = 1) -> int:
    """K and V of one block across all layers, on one device: with tensor parallelism
    each device holds num_kv_heads / tensor_parallel_size heads of every block."""
    heads = cfg.num_kv_heads // tensor_parallel_size
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> dict:
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def copy_blocks(kv_cache: dict, src: jnp.ndarray, dst: jnp.ndarray) -> dict:
    """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write). Padding entries
    are (0, 0): the null block onto itself, a no-op."""
    return {name: cache.at[:, dst].set(cache[:, src]) for name, cache in kv_cache.items()}
