"""The platform layer (paged_jax/platform/): what each device kind decides, and that the
engine takes it from there."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention.paged_attention import scatter_kv
from paged_jax.config.engine_config import EngineConfig
from paged_jax.engine import kv_sizing
from paged_jax.model.linear import XLA_LINEAR
from paged_jax.platform import EngineDefaults, Platform, current_platform, platform_named
from paged_jax.platform import cpu as cpu_platform
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference


def test_jax_platform_names_map_to_platforms():
    assert current_platform().name == "cpu"  # the test machine
    for name in ("gpu", "cuda", "rocm"):
        assert platform_named(name).name == "gpu"
    assert platform_named("tpu").name == "tpu"
    other = platform_named("metal")  # another JAX backend: the portable behaviour
    assert other.name == "metal" and type(other) is Platform


def test_gpu_takes_the_pallas_kernels_tpu_the_reference():
    assert platform_named("gpu").auto_attention_backend() == "pallas"
    assert platform_named("tpu").auto_attention_backend() == "reference"
    assert platform_named("metal").auto_attention_backend() == "reference"


def test_cpu_takes_the_native_kernel_where_it_builds(monkeypatch):
    platform = platform_named("cpu")
    monkeypatch.setattr(cpu_platform.build, "available", lambda: True)
    assert platform.auto_attention_backend() == "native"
    monkeypatch.setattr(cpu_platform.build, "available", lambda: False)
    assert platform.auto_attention_backend() == "pallas"
    with pytest.raises(ValueError, match="does not run on this cpu machine"):
        platform.resolve_attention_backend("native")


def test_native_attention_is_refused_off_cpu():
    for name in ("gpu", "tpu"):
        with pytest.raises(ValueError, match=f"'native' does not run on this {name} machine"):
            platform_named(name).resolve_attention_backend("native")
        assert platform_named(name).resolve_attention_backend("reference") == "reference"


def test_accelerators_use_xla_linear_and_the_portable_kernels():
    for name in ("gpu", "tpu"):
        platform = platform_named(name)
        assert platform.serving_linear({"layers": {}}, object, None) is XLA_LINEAR
        kernels = platform.attention_kernels("reference")
        assert kernels.write is scatter_kv and kernels.attend is ragged_paged_attention_reference
        assert platform.kv_cache_dtype("bfloat16", "pallas") == "bfloat16"
    assert platform_named("tpu").attention_kernels("pallas").attend is ragged_paged_attention


def test_accelerators_fuse_the_sampling_head_the_cpu_splits_it():
    """One dispatch per step where a device computes and the host waits; the CPU keeps the head
    as its own call (paged_jax/worker/step_head.py says why); another backend gets the base's."""
    assert platform_named("gpu").fused_head and platform_named("tpu").fused_head
    assert platform_named("rocm").fused_head and platform_named("other").fused_head
    assert not platform_named("cpu").fused_head


def test_cpu_keeps_an_xla_written_cache_in_float32():
    cpu = platform_named("cpu")
    assert cpu.kv_cache_dtype("bfloat16", "pallas") == "float32"  # XLA's CPU scatter has no bf16 path
    assert cpu.kv_cache_dtype("bfloat16", "native") == "bfloat16"
    assert cpu.kv_cache_dtype("float32", "native") == "float32"


def test_engine_defaults_come_from_the_platform(tiny_llama):
    """Fields left None take the platform's defaults; fields set are kept, and a default never
    exceeds what was set (a smaller token budget or largest bucket)."""
    fake = Platform()
    fake.name = "cpu"
    fake.defaults = EngineDefaults(max_num_seqs=24, max_num_batched_tokens=96, kv_cache_memory_bytes=2**20,
                                   layer_loop="unroll")
    resolved = kv_sizing.resolve_config(EngineConfig(), tiny_llama.config, check_memory=False, platform=fake)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.layer_loop) == (24, 96, "unroll")
    assert resolved.seq_buckets[-1] == 24 and resolved.token_buckets[-1] == 96
    per_block = kv_sizing.bytes_per_block(tiny_llama.config, resolved.block_size, resolved.kv_cache_dtype)
    assert resolved.num_blocks == max(2**20 // per_block, 2)
    mine = kv_sizing.resolve_config(EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, layer_loop="scan"),
                                    tiny_llama.config, check_memory=False, platform=fake)
    assert (mine.max_num_seqs, mine.max_num_batched_tokens, mine.layer_loop) == (4, 32, "scan")
    capped = kv_sizing.resolve_config(EngineConfig(max_num_batched_tokens=16), tiny_llama.config,
                                      check_memory=False, platform=fake)
    assert (capped.max_num_seqs, capped.max_num_batched_tokens) == (16, 16)
    bucketed = kv_sizing.resolve_config(EngineConfig(seq_buckets=(2, 8), token_buckets=(8, 64)), tiny_llama.config,
                                        check_memory=False, platform=fake)
    assert (bucketed.max_num_seqs, bucketed.max_num_batched_tokens) == (8, 64)


def test_cpu_defaults_are_the_settings_of_the_cpu_records():
    """The CPU's float32 record against vLLM (experiments/results/peer_vllm.json) ran with
    these sequences and tokens per step: a user of LLM() gets those, not slower ones."""
    import json
    import pathlib
    record = json.loads((pathlib.Path(__file__).parents[2] / "experiments/results/peer_vllm.json").read_text())
    defaults = platform_named("cpu").defaults
    assert record["flags"]["dtype"] == "float32"  # EngineConfig's default dtype
    assert defaults.max_num_seqs == record["flags"]["max_num_seqs"]
    assert defaults.max_num_batched_tokens == record["flags"]["max_num_batched_tokens"]


def test_engine_config_validates_defaults_once_filled():
    assert EngineConfig().max_num_seqs is None and EngineConfig().seq_buckets is None
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="largest seq/token bucket"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, seq_buckets=(4,))
    with pytest.raises(ValueError, match="ints >= 1"):
        EngineConfig(seq_buckets=(0, 4))
    filled = dataclasses.replace(EngineConfig(), max_num_seqs=8, max_num_batched_tokens=64)
    assert filled.seq_buckets[-1] == 8 and filled.token_buckets[-1] == 64


def test_scatter_kv_writes_rows_and_drops_padding():
    """cache [L=2, N=3, B=2, H=1, D=1]; rows 7, 8 at slots 3 (block 1, offset 1) and 6 (out of range: dropped)
    of layer 1."""
    cache = jnp.zeros((2, 3, 2, 1, 1), jnp.float32)
    out = np.asarray(scatter_kv(cache, jnp.array([[[7.0]], [[8.0]]]), jnp.array([3, 6]), 1))
    want = np.zeros((2, 3, 2, 1, 1), np.float32)
    want[1, 1, 1] = 7.0
    np.testing.assert_array_equal(out, want)
