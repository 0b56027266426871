"""`EngineConfig.kv_allocator` names -> KV allocators: where the paper's baselines plug in.

Why here, above the engine: the engine core and its statistics know only the allocator
interface (the paged BlockManager's: allocate_slots, free, table_update, ...; waste
through core/kv_waste.py), and nothing in paged_jax/core/ or paged_jax/engine/ imports
paged_jax/baselines/ (tests/test_baselines_plug_in.py). So the one place that turns the
names "contiguous-max", "contiguous-pow2" and "contiguous-oracle" into allocators sits
with the entry points, as vLLM keeps its `LLM` in `vllm/entrypoints/llm.py`: `paged_jax.LLM`
passes `make_allocator` to the engine, and so does any code that builds an LLMEngine or
EngineCore for a baseline (`LLMEngine(model, config, allocator_factory=make_allocator)`).
"""

from __future__ import annotations

from paged_jax.baselines.contiguous_allocator import CONTIGUOUS_POLICIES, ContiguousAllocator
from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine.engine_core import paged_allocator


def make_allocator(config: EngineConfig, num_host_blocks: int):
    """The allocator `config.kv_allocator` names, sized by the resolved `config`
    (num_blocks, block_size, max_model_len set); `num_host_blocks`: swap space in blocks
    (the paged allocator's; the baselines have no swap). EngineCore's
    `allocator_factory` signature."""
    if config.kv_allocator in CONTIGUOUS_POLICIES:  # validated by EngineConfig: recompute, no prefix caching
        return ContiguousAllocator(config.num_blocks, config.block_size, policy=config.kv_allocator,
                                   max_model_len=config.max_model_len)
    return paged_allocator(config, num_host_blocks)
