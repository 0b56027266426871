"""`kv_allocator=` names become allocators above the engine (entrypoints/allocators.py).

The engine core knows only the allocator interface: given a baseline's name and no
allocator factory it refuses, saying where the factory is, before it builds anything;
`make_allocator` maps every name EngineConfig accepts.
"""

import pytest

from paged_jax.baselines.contiguous_allocator import ContiguousAllocator
from paged_jax.config.engine_config import KV_ALLOCATORS, EngineConfig
from paged_jax.core.block_manager import BlockManager
from paged_jax.engine.engine_core import EngineCore
from paged_jax.entrypoints.allocators import make_allocator

SIZED = dict(block_size=4, num_blocks=33, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("name", KV_ALLOCATORS)
def test_make_allocator_builds_what_each_name_says(name):
    allocator = make_allocator(EngineConfig(kv_allocator=name, **SIZED), num_host_blocks=0)
    if name == "paged":
        assert type(allocator) is BlockManager
    else:
        assert isinstance(allocator, ContiguousAllocator) and allocator.policy == name
        assert allocator.max_model_len == 64
    assert allocator.block_size == 4 and allocator.num_usable_blocks == 32


def test_the_engine_core_refuses_a_baseline_name_without_a_factory(tiny_llama):
    def never_built(*args, **kwargs):
        raise AssertionError("the runner must not be built for a refused allocator")

    config = EngineConfig(kv_allocator="contiguous-max", **SIZED)
    with pytest.raises(ValueError, match="allocator_factory=paged_jax.entrypoints.allocators.make_allocator"):
        EngineCore(tiny_llama.config, None, config, runner_factory=never_built)
