"""GPU/TPU engine defaults (paged_jax/platform/base.py ACCELERATOR_DEFAULTS, engine/kv_sizing.py):
256 sequences and 8192 tokens per step, and a KV cache that takes gpu_memory_utilization of the
device memory free once the weights are loaded; the CPU keeps its own. The devices are fakes whose
memory statistics the test sets, as XLA's allocator reports them (bytes_limit, bytes_in_use)."""

import logging

import pytest

from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from paged_jax.engine import kv_sizing
from paged_jax.platform import platform_named
from paged_jax.worker.batch_inputs import all_batch_shapes, batch_shape_kinds
from paged_jax.worker.kv_cache import bytes_per_block

GIB = 2**30


class _Device:
    platform = "gpu"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return "fake gpu:0"


def _gpu(stats):
    """The real GPU platform whose devices report `stats`."""
    platform = platform_named("gpu")
    platform.local_devices = lambda count: [_Device(stats)] * count
    return platform


def _block(model_config, dtype="float32"):
    return bytes_per_block(model_config, 16, dtype)


@pytest.mark.parametrize("utilization", [0.9, 0.5, 1.0])
def test_the_kv_cache_takes_the_fraction_of_free_device_memory(tiny_llama, utilization):
    """3 GiB limit, 1 GiB in use (the weights): 2 GiB free; the cache gets `utilization` of it,
    in whole blocks, and that budget passes the fit check it was sized for."""
    gpu = _gpu({"bytes_limit": 3 * GIB, "bytes_in_use": GIB})
    config = EngineConfig(gpu_memory_utilization=utilization)
    for check_memory in (True, False):
        resolved = kv_sizing.resolve_config(config, tiny_llama.config, check_memory=check_memory, platform=gpu)
        assert resolved.num_blocks == int(2 * GIB * utilization) // _block(tiny_llama.config)
    # a tenth less in use is a tenth of a GiB more cache
    more = kv_sizing.resolve_config(config, tiny_llama.config, platform=_gpu({"bytes_limit": 3 * GIB,
                                                                              "bytes_in_use": 0.9 * GIB}))
    assert more.num_blocks == int(2.1 * GIB * utilization) // _block(tiny_llama.config)


def test_accelerators_take_256_sequences_and_8192_tokens_the_cpu_64_and_1024(tiny_llama):
    gpu = _gpu({"bytes_limit": 3 * GIB, "bytes_in_use": GIB})
    resolved = kv_sizing.resolve_config(EngineConfig(), tiny_llama.config, platform=gpu)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.async_scheduling) == (256, 8192, True)
    for name in ("gpu", "tpu"):
        defaults = platform_named(name).defaults
        assert (defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.kv_from_free_memory) == (256, 8192,
                                                                                                          True)
    cpu = platform_named("cpu").defaults
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.kv_cache_memory_bytes, cpu.kv_from_free_memory) == (
        64, 1024, 512 * 2**20, False)


def test_warm_up_compiles_46_programs_at_the_accelerator_defaults(tiny_llama):
    """Powers of two with 1.5x midpoints from 32: 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256 rows
    (12 decode shapes, each at its own token count) and, for mixed steps at 256 rows, the token
    buckets above 256: 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192 (10). The GPU's
    kernels split decode steps, so the 256-row decode shape also gets a mixed program (23), and
    the fused head has a greedy and a sampling variant of each: 46 step programs."""
    gpu = _gpu({"bytes_limit": 3 * GIB, "bytes_in_use": GIB})
    resolved = kv_sizing.resolve_config(EngineConfig(), tiny_llama.config, platform=gpu)
    assert resolved.seq_buckets == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    shapes = all_batch_shapes(resolved.seq_buckets, resolved.token_buckets)
    assert len(shapes) == 12 + 10
    assert [t for s, t in shapes if s == 256 and t > 256] == [384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                                                              8192]
    kinds = batch_shape_kinds(resolved.seq_buckets, resolved.token_buckets)
    assert set(kinds) == set(shapes) and 2 * sum(map(len, kinds.values())) == 46


def test_an_explicit_budget_or_block_count_wins(tiny_llama):
    gpu = _gpu({"bytes_limit": 3 * GIB, "bytes_in_use": GIB})
    block = _block(tiny_llama.config)
    budget = kv_sizing.resolve_config(EngineConfig(kv_cache_memory_bytes=100 * block), tiny_llama.config,
                                      platform=gpu)
    assert budget.num_blocks == 100
    assert kv_sizing.resolve_config(EngineConfig(num_blocks=77), tiny_llama.config, platform=gpu).num_blocks == 77


def test_an_explicit_budget_beyond_the_fraction_is_refused(tiny_llama):
    """2 GiB free at 0.5: 1 GiB may go to the cache; 1 GiB and a block more is refused, naming
    the setting and the largest budget that fits (the default's own)."""
    gpu = _gpu({"bytes_limit": 3 * GIB, "bytes_in_use": GIB})
    block = _block(tiny_llama.config)
    fits = GIB // block
    config = EngineConfig(gpu_memory_utilization=0.5, num_blocks=fits + 1)
    with pytest.raises(ValueError, match=rf"may take 50% \(gpu_memory_utilization.*num_blocks={fits}\)"):
        kv_sizing.resolve_config(config, tiny_llama.config, platform=gpu)
    assert kv_sizing.resolve_config(EngineConfig(gpu_memory_utilization=0.5, num_blocks=fits), tiny_llama.config,
                                    platform=gpu).num_blocks == fits


def test_a_device_without_memory_statistics_gets_the_fixed_budget_and_a_warning(tiny_llama, caplog):
    for stats in (None, {"bytes_in_use": GIB}):  # no statistics; statistics without a limit
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paged_jax.engine.kv_sizing"):
            resolved = kv_sizing.resolve_config(EngineConfig(), tiny_llama.config, platform=_gpu(stats))
        assert resolved.num_blocks == DEFAULT_KV_CACHE_MEMORY_BYTES // _block(tiny_llama.config)
        assert "reports no memory statistics" in caplog.text and "fake gpu:0" in caplog.text


def test_the_cpu_keeps_its_byte_budget_whatever_memory_is_free(tiny_llama):
    """A CPU platform given devices that report 1 TiB free still sizes the cache at 512 MiB."""
    cpu = platform_named("cpu")
    cpu.local_devices = lambda count: [_Device({"bytes_limit": 2**40, "bytes_in_use": 0})] * count
    resolved = kv_sizing.resolve_config(EngineConfig(), tiny_llama.config, check_memory=False, platform=cpu)
    assert resolved.num_blocks == DEFAULT_KV_CACHE_MEMORY_BYTES // _block(tiny_llama.config, resolved.kv_cache_dtype)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, True, "0.9", None])
def test_gpu_memory_utilization_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=bad)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1
