"""A KV budget larger than the machine can hold is refused at start, before anything is
allocated, with the largest budget that would fit (kv_sizing.py). The budget too small
for max_model_len: test_engine_api.py::test_kv_budget_too_small_names_the_largest_max_model_len.

The free memory is the real one (this host's MemAvailable) where the test only needs
"far too much", and a fixed figure (`available_memory` replaced) where it checks the
arithmetic, since the real figure moves while other processes run.
"""

import dataclasses
import re

import pytest

from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from paged_jax.engine import kv_sizing
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.worker.kv_cache import bytes_per_block

GIB = 2**30
SMALL = dict(block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, seq_buckets=(4,),
             token_buckets=(32,))


def never_built(*args, **kwargs):
    raise AssertionError("the runner was built: the KV cache would have been allocated")


def largest_suggested(message: str) -> tuple[int, int]:
    match = re.search(r"the largest that fits is kv_cache_memory_bytes=(\d+) \(num_blocks=(\d+)\)", message)
    assert match, message
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("budget", [dict(kv_cache_memory_bytes=2**50), dict(num_blocks=10**9)],
                         ids=["kv_cache_memory_bytes", "num_blocks"])
def test_a_budget_beyond_this_machine_is_refused(tiny_llama, budget):
    """1 PiB (or a billion blocks) against this host's real free memory: a ValueError
    naming the setting, what the cache would take, what is free and the largest budget
    that fits. (Called on resolve_config, not on an engine: without the check, an engine
    would build a billion-block pool on the host and be killed for memory.)"""
    with pytest.raises(ValueError, match="the KV cache does not fit in memory") as err:
        kv_sizing.resolve_config(EngineConfig(**SMALL, **budget), tiny_llama.config)
    message = str(err.value)
    name, value = next(iter(budget.items()))
    assert f"{name}={value} is " in message and "MemAvailable" in message, message
    suggested_bytes, suggested_blocks = largest_suggested(message)
    assert suggested_bytes == suggested_blocks * bytes_per_block(tiny_llama.config, 16, "float32")
    free = kv_sizing.available_memory([_Cpu()])[0]
    assert 0 < suggested_bytes <= free, (suggested_bytes, free)


def test_the_engine_refuses_it_before_allocating_anything(tiny_llama, free_memory):
    """LLMEngine stops at the check: no block pool, no runner, no device buffer."""
    free_memory(64 * 2**20)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=134217728 is 16384 blocks .* 64.0 MiB free"):
        LLMEngine(tiny_llama, EngineConfig(**SMALL, kv_cache_memory_bytes=128 * 2**20), runner_factory=never_built)


class _Cpu:
    platform = "cpu"


class _Accelerator:
    platform = "gpu"

    def __init__(self, name: str, stats):
        self.name, self.stats = name, stats

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return self.name


@pytest.fixture
def free_memory(monkeypatch):
    """Set the free memory the check sees: free_memory(bytes)."""
    def set_free(num_bytes: int):
        monkeypatch.setattr(kv_sizing, "available_memory", lambda devices: (num_bytes, "the test's machine"))
        monkeypatch.setattr(kv_sizing, "host_available", lambda: (num_bytes, "the test's host"))
    return set_free


def test_the_suggested_budget_fits_and_one_block_more_does_not(tiny_llama, free_memory):
    cfg = tiny_llama.config
    block = bytes_per_block(cfg, 16, "float32")
    free_memory(1000 * block)  # 90% of it: 900 blocks
    with pytest.raises(ValueError) as err:
        kv_sizing.resolve_config(EngineConfig(**SMALL, kv_cache_memory_bytes=10**6 * block), cfg)
    assert largest_suggested(str(err.value)) == (900 * block, 900)
    assert kv_sizing.resolve_config(EngineConfig(**SMALL, kv_cache_memory_bytes=900 * block), cfg).num_blocks == 900
    assert kv_sizing.resolve_config(EngineConfig(**SMALL, num_blocks=900), cfg).num_blocks == 900
    with pytest.raises(ValueError, match=r"num_blocks=901 is 901 blocks .* \(num_blocks=900\)"):
        kv_sizing.resolve_config(EngineConfig(**SMALL, num_blocks=901), cfg)
    # a simulated engine allocates nothing: no check
    assert kv_sizing.resolve_config(EngineConfig(**SMALL, num_blocks=901), cfg, check_memory=False).num_blocks == 901
    free_memory(block)  # not even the two smallest blocks
    with pytest.raises(ValueError, match=r"not even the smallest cache \(2 blocks\) fits"):
        kv_sizing.resolve_config(EngineConfig(**SMALL, num_blocks=2), cfg)


def test_the_default_budget_passes_on_a_24_gib_machine_and_says_so_when_it_does_not(tiny_llama, free_memory):
    from configs import get_config
    for model in (tiny_llama.config, get_config("smollm2_135m")):
        free_memory(20 * GIB)  # what a 24 GiB machine has free with a model loaded
        assert kv_sizing.resolve_config(EngineConfig(), model).num_blocks >= 2
        free_memory(256 * 2**20)
        with pytest.raises(ValueError, match=r"the default budget of 512.0 MiB is \d+ blocks"):
            kv_sizing.resolve_config(EngineConfig(), model)
    assert DEFAULT_KV_CACHE_MEMORY_BYTES == 512 * 2**20


def test_the_default_budget_passes_here(tiny_llama):
    """The real check on this machine (and in CI): the default budget is far below it."""
    assert kv_sizing.resolve_config(EngineConfig(), tiny_llama.config).num_blocks >= 2


def test_accelerators_report_the_least_free_device():
    """bytes_limit - bytes_in_use of the device with least free (the budget is per device);
    no figure (no check) where a backend keeps no statistics."""
    devices = [_Accelerator("gpu:0", {"bytes_limit": 80 * GIB, "bytes_in_use": 2 * GIB}),
               _Accelerator("gpu:1", {"bytes_limit": 80 * GIB, "bytes_in_use": 30 * GIB})]
    free, where = kv_sizing.available_memory(devices)
    assert free == 50 * GIB and "gpu:1" in where
    assert kv_sizing.available_memory([_Accelerator("tpu:0", None)]) is None
    assert kv_sizing.available_memory([_Accelerator("x:0", {"bytes_in_use": 1})]) is None


def test_cpu_devices_share_the_hosts_memory(tiny_llama, free_memory, monkeypatch):
    """Tensor parallelism over CPU devices: each holds 1/tp of every block, all in the
    same host memory, so the check is on their sum."""
    cfg = tiny_llama.config
    per_device = bytes_per_block(cfg, 16, "float32", 2)
    monkeypatch.setattr(kv_sizing.jax, "local_devices", lambda: [_Cpu(), _Cpu()])
    free_memory(1000 * per_device)  # 90%: 900 per-device blocks, 450 blocks on each of the two
    assert kv_sizing.resolve_config(EngineConfig(**SMALL, num_blocks=450, tensor_parallel_size=2), cfg)
    with pytest.raises(ValueError, match=r"for 2 devices.*\(num_blocks=450\)"):
        kv_sizing.resolve_config(EngineConfig(**SMALL, num_blocks=451, tensor_parallel_size=2), cfg)


def test_swap_space_beyond_the_host_is_refused_with_the_largest_that_fits(tiny_llama, free_memory):
    """preemption_mode="swap" allocates swap_space_bytes of host blocks; on CPU they share
    the host's memory with the device cache, so the room is 90% of it less the cache."""
    cfg = tiny_llama.config
    block = bytes_per_block(cfg, 16, "float32")
    swap = dict(SMALL, num_blocks=300, preemption_mode="swap")
    free_memory(1000 * block)  # 900 blocks in all: 300 in the device cache leave 600 for swap
    assert kv_sizing.resolve_config(EngineConfig(**swap, swap_space_bytes=600 * block), cfg).num_blocks == 300
    with pytest.raises(ValueError) as err:
        kv_sizing.resolve_config(EngineConfig(**swap, swap_space_bytes=601 * block), cfg)
    message = str(err.value)
    assert message.startswith(f"the swap space does not fit in memory: swap_space_bytes={601 * block} is 601 "
                              f"host blocks"), message
    assert "on top of the KV cache" in message and "the test's host" in message, message
    assert f"the largest that fits is swap_space_bytes={600 * block} (600 host blocks)" in message, message
    # recompute preemption allocates no swap space: no check; nor a simulated engine
    assert kv_sizing.resolve_config(EngineConfig(**dict(swap, preemption_mode="recompute"),
                                                 swap_space_bytes=10**6 * block), cfg).num_blocks == 300
    assert kv_sizing.resolve_config(EngineConfig(**swap, swap_space_bytes=10**6 * block), cfg,
                                    check_memory=False).num_blocks == 300
    free_memory(301 * block)  # 270 blocks: not even the device cache plus one host block
    with pytest.raises(ValueError, match="the KV cache does not fit"):
        kv_sizing.resolve_config(EngineConfig(**swap, swap_space_bytes=block), cfg)
    free_memory(334 * block)  # 300.6 blocks: the cache fits, no swap block does
    with pytest.raises(ValueError, match="no swap space fits: use preemption_mode='recompute'"):
        kv_sizing.resolve_config(EngineConfig(**swap, swap_space_bytes=block), cfg)


def test_accelerators_check_swap_space_against_the_host_alone(tiny_llama, free_memory, monkeypatch):
    """On an accelerator the device cache is not in host memory: swap may take all 90%."""
    cfg = tiny_llama.config
    block = bytes_per_block(cfg, 16, "float32")
    free_memory(1000 * block)
    monkeypatch.setattr(kv_sizing.jax, "local_devices", lambda: [_Accelerator("gpu:0", None)])
    monkeypatch.setattr(kv_sizing.jax, "default_backend", lambda: "gpu")
    config = EngineConfig(**SMALL, num_blocks=300, preemption_mode="swap", swap_space_bytes=900 * block,
                          attention_backend="reference", kv_cache_dtype="float32")
    assert kv_sizing.resolve_config(config, cfg).num_blocks == 300
    with pytest.raises(ValueError, match=r"swap_space_bytes=\d+ is 901 host blocks .*the test's host") as err:
        kv_sizing.resolve_config(dataclasses.replace(config, swap_space_bytes=901 * block), cfg)
    assert "on top of the KV cache" not in str(err.value)
