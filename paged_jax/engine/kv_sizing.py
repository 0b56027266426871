"""How big the KV cache is, and whether the requests an engine accepts can fit in it.

Settled once when the engine core starts (what was left open in EngineConfig, from the
model and the platform) and checked per request, so that nothing is accepted that could
never run to completion: a request whose sequences cannot all be in the cache at once
would preempt itself forever.

The cache must also fit the machine. A budget larger than the memory free when the
engine starts (weights already loaded) would otherwise fail late and obscurely: XLA's
RESOURCE_EXHAUSTED in the middle of the warm-up on an accelerator, and on CPU an
allocation that succeeds (Linux overcommits) and then swaps or gets the process killed
by the OOM killer once the cache is touched. So `resolve_config` refuses it before
anything is allocated, naming the largest budget that would fit; likewise swap space
(host memory for swapped-out blocks) that the host cannot hold.

On GPU and TPU, a budget left open is the largest that passes that check: the share
EngineConfig.gpu_memory_utilization of the device's free memory, read once here from
`memory_stats()` (XLA allocator's "bytes_limit" - "bytes_in_use": the weights are on the
device by now), so the default and the check cannot disagree. Where a device keeps no
statistics, the platform's fixed byte budget is used and a warning says so.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from paged_jax.config.engine_config import DEFAULT_KV_CACHE_MEMORY_BYTES, DEFAULT_MAX_MODEL_LEN, EngineConfig
from paged_jax.config.model_config import ModelConfig
from paged_jax.platform import Platform, current_platform
from paged_jax.worker.kv_cache import bytes_per_block

# The share of the host's free memory swap space (and, on CPU, the KV cache with it) may
# take: the rest is for everything else the host runs. The KV cache's own share is
# EngineConfig.gpu_memory_utilization (default the same 0.9). The checks are for budgets
# that cannot work, not a tuning of ones that can.
KV_MEMORY_FRACTION = 0.9

_log = logging.getLogger(__name__)


def resolve_config(config: EngineConfig, model_config: ModelConfig, *, check_memory: bool = True,
                   platform: Platform | None = None) -> EngineConfig:
    """Fill what was left open from the model and the platform (paged_jax/platform/, default
    the one of JAX's default backend): max_model_len, num_blocks, the attention backend
    behind "auto", the KV cache's dtype, the layer loop, and the platform's defaults for
    max_num_seqs / max_num_batched_tokens / the KV budget, and async scheduling. With `check_memory` (an engine
    that allocates its cache; not a simulated one), a cache larger than the devices' free
    memory is a ValueError naming the largest that fits."""
    platform = platform or current_platform()
    defaults = platform.defaults
    devices = platform.local_devices(config.tensor_parallel_size)
    free = _FreeMemory(devices)  # read once, at most: for the default budget and for the check
    model_limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or min(model_limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {model_limit}")
    backend = platform.resolve_attention_backend(config.attention_backend)
    kv_dtype = config.kv_cache_dtype
    if kv_dtype == "auto":
        kv_dtype = platform.kv_cache_dtype(config.dtype, backend)
    num_blocks = config.num_blocks
    if num_blocks is None:
        budget = config.kv_cache_memory_bytes or default_kv_budget(config, defaults, free)
        num_blocks = budget // bytes_per_block(model_config, config.block_size, kv_dtype,
                                               config.tensor_parallel_size)  # the budget is per device
    # platform defaults for what was left open, never above what was set (a token budget or the
    # largest bucket given): a setting the user made is never refused for a default's sake
    seq_caps = [cap for cap in (config.max_num_batched_tokens, config.seq_buckets and config.seq_buckets[-1]) if cap]
    max_num_seqs = config.max_num_seqs or min([defaults.max_num_seqs, *seq_caps])
    token_caps = [config.token_buckets[-1]] if config.token_buckets else []
    max_num_batched_tokens = config.max_num_batched_tokens or max(max_num_seqs,
                                                                  min([defaults.max_num_batched_tokens, *token_caps]))
    resolved = dataclasses.replace(config, max_model_len=max_model_len, num_blocks=max(int(num_blocks), 2),
                                   attention_backend=backend, kv_cache_dtype=kv_dtype,
                                   layer_loop=defaults.layer_loop if config.layer_loop == "auto" else config.layer_loop,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   async_scheduling=(platform.async_scheduling if config.async_scheduling is None
                                                     else config.async_scheduling))
    if check_memory:
        check_fits_memory(resolved, config, model_config, devices, free.read(), defaults)
        check_swap_fits_host(resolved, model_config, devices)
    return resolved


class _FreeMemory:
    """`available_memory(devices)`, read on first use and kept: one figure for one start."""

    def __init__(self, devices):
        self.devices, self._read, self._value = devices, False, None

    def read(self) -> tuple[int, str] | None:
        if not self._read:
            self._value, self._read = available_memory(self.devices), True
        return self._value


def default_kv_budget(config: EngineConfig, defaults, free: _FreeMemory) -> int:
    """The KV budget (bytes per device) when neither num_blocks nor kv_cache_memory_bytes is
    given: on a platform whose defaults size it from free memory (GPU, TPU),
    gpu_memory_utilization of the least free device's free memory; elsewhere, or where the
    device reports no memory statistics (then with a warning), the platform's fixed budget."""
    if not defaults.kv_from_free_memory:
        return defaults.kv_cache_memory_bytes
    reading = free.read()
    if reading is None:
        _log.warning("%s reports no memory statistics (memory_stats() has no bytes_limit): the KV cache gets "
                     "the fixed default of %s; set kv_cache_memory_bytes or num_blocks to size it",
                     free.devices[0] if free.devices else "this device", _gib(defaults.kv_cache_memory_bytes))
        return defaults.kv_cache_memory_bytes
    return int(reading[0] * config.gpu_memory_utilization)


def host_available() -> tuple[int, str] | None:
    """(bytes, where from): this host's MemAvailable (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this host (MemAvailable in /proc/meminfo)"
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(devices) -> tuple[int, str] | None:
    """(bytes free, where that figure comes from) on the least free of `devices`, or None
    where the platform does not say. CPU: the host's MemAvailable (Linux; what can be
    allocated without swapping). Accelerators: XLA's allocator limit minus what is in use
    (the weights, by the time the engine sizes its cache)."""
    if devices[0].platform == "cpu":
        return host_available()
    free = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without memory statistics
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append((int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), device))
    bytes_free, device = min(free, key=lambda x: x[0])
    return bytes_free, f"{device} (its allocator's bytes_limit - bytes_in_use)"


def check_fits_memory(resolved: EngineConfig, asked: EngineConfig, model_config: ModelConfig, devices=None,
                      free: tuple[int, str] | None = None, defaults=None) -> None:
    """Refuse a KV cache that exceeds gpu_memory_utilization of the free memory `free`
    (default: read now from `devices`, default JAX's first tensor_parallel_size): per device
    on accelerators (the budget is per device), all devices' together on CPU."""
    tp = resolved.tensor_parallel_size
    if devices is None:
        devices = jax.local_devices()[:tp]
        free = available_memory(devices)
    if free is None:
        return
    bytes_free, where = free
    fraction = resolved.gpu_memory_utilization
    block_bytes = bytes_per_block(model_config, resolved.block_size, resolved.kv_cache_dtype, tp)
    shared = len(devices) if devices[0].platform == "cpu" else 1  # CPU "devices" share the host's memory
    needed = resolved.num_blocks * block_bytes * shared
    fits_blocks = int(bytes_free * fraction) // (block_bytes * shared)
    if resolved.num_blocks <= fits_blocks:
        return
    if asked.num_blocks is not None:
        source = f"num_blocks={asked.num_blocks}"
    elif asked.kv_cache_memory_bytes is not None:
        source = f"kv_cache_memory_bytes={asked.kv_cache_memory_bytes}"
    else:
        default = defaults.kv_cache_memory_bytes if defaults is not None else DEFAULT_KV_CACHE_MEMORY_BYTES
        source = f"the default budget of {_gib(default)}"
    fix = (f"the largest that fits is kv_cache_memory_bytes={fits_blocks * block_bytes} (num_blocks={fits_blocks})"
           if fits_blocks >= 2 else "not even the smallest cache (2 blocks) fits: free memory first")
    raise ValueError(
        f"the KV cache does not fit in memory: {source} is {resolved.num_blocks} blocks of {resolved.block_size} "
        f"tokens at {block_bytes} bytes each ({resolved.kv_cache_dtype}) = {_gib(needed)}"
        f"{f' for {shared} devices' if shared > 1 else ' per device'}, but "
        f"{where} has {_gib(bytes_free)} free, of which the cache may take {fraction:.0%} "
        f"(gpu_memory_utilization; the rest is for activations and compiled programs); {fix}")


def check_swap_fits_host(resolved: EngineConfig, model_config: ModelConfig, devices=None) -> None:
    """Refuse swap space (preemption_mode="swap": whole blocks in host memory, numpy arrays
    that Linux hands out lazily and that fail only once swapped blocks touch them) larger
    than KV_MEMORY_FRACTION of the host's free memory; on CPU less the device KV cache,
    which lives in the same memory."""
    if resolved.preemption_mode != "swap":
        return
    host_block = bytes_per_block(model_config, resolved.block_size, resolved.kv_cache_dtype)  # whole blocks
    swap = resolved.swap_space_bytes // host_block * host_block
    free = host_available()
    if swap == 0 or free is None:
        return
    bytes_free, where = free
    tp = resolved.tensor_parallel_size
    devices = jax.local_devices()[:tp] if devices is None else devices
    kv = 0
    if devices[0].platform == "cpu":
        kv = resolved.num_blocks * bytes_per_block(model_config, resolved.block_size, resolved.kv_cache_dtype,
                                                   tp) * len(devices)
    room = int(bytes_free * KV_MEMORY_FRACTION) - kv
    if swap <= room:
        return
    fix = (f"the largest that fits is swap_space_bytes={room // host_block * host_block} "
           f"({room // host_block} host blocks)" if room >= host_block else
           "no swap space fits: use preemption_mode='recompute' or a smaller KV cache")
    raise ValueError(
        f"the swap space does not fit in memory: swap_space_bytes={resolved.swap_space_bytes} is "
        f"{swap // host_block} host blocks of {host_block} bytes = {_gib(swap)}"
        f"{f' on top of the KV cache (in the same memory on CPU) of {_gib(kv)}' if kv else ''}, but {where} has "
        f"{_gib(bytes_free)} free, of which the caches may take {KV_MEMORY_FRACTION:.0%}; {fix}")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


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
