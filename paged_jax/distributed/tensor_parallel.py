"""Tensor parallelism over a JAX device mesh: Megatron-style sharding by attention head.

Why JAX's own SPMD machinery (a `Mesh`, `NamedSharding`s, `jax.shard_map`) and no RPC
layer of our own: the same jitted step then runs on N CPU devices, a multi-GPU host, a
TPU slice or several hosts (`paged_jax/distributed/multihost.py`), and XLA picks and schedules the
collectives.

The scheme, on a 1-D mesh with axis `TP_AXIS` of N devices:

* Parameters (layout in `paged_jax.model.llama`): column-parallel `wq wk wv w_gate w_up` and
  the q/k/v biases are split on their output axis, row-parallel `wo w_down` on their
  input axis, so each device computes whole heads (and a slice of the MLP) and XLA's
  SPMD partitioner adds exactly one all-reduce after `wo` and one after `w_down` per
  layer. The embedding and an untied `lm_head` are split over the vocabulary (so the
  per-device parameter bytes are ~1/N); norms and `bo` are tiny and replicated. A
  dimension that N does not divide (vocabulary, MLP width) stays replicated rather
  than padded: correct, only less memory saved.
* The KV cache `[L, num_blocks, block_size, Hkv, D]` is split on its KV-head axis:
  every device holds all `num_blocks` blocks, each with its own Hkv/N heads. Block ids
  therefore mean the same on every device and the one host-side block manager, the
  scheduler and the batch metadata (replicated) are unchanged. `bytes_per_block` of one
  device is 1/N of the whole, so a per-device KV budget buys N times the blocks.
* Attention (the cache write at the slots and the Pallas kernel or jnp reference) runs
  per shard under `jax.shard_map`: the kernel sees Hq/N query heads and Hkv/N KV heads.
  Both counts must divide by N, so GQA groups never straddle devices and no K/V ever
  crosses a device (no all-gather of the cache; tests/distributed/test_tensor_parallel.py checks
  the compiled HLO).
* Logits (vocab-sharded) are gathered to every device before sampling, so sampling
  runs replicated and every device (and process) agrees on the sampled tokens.

tensor_parallel_size=1 never builds a mesh: the runner takes today's single-device path.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax.config.model_config import ModelConfig
from paged_jax.model.llama import Params

TP_AXIS = "tp"
COLUMN_PARALLEL = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up")  # split on the last (output) axis
ROW_PARALLEL = ("wo", "w_down")  # [L, in, out]: split on the input axis
CACHE_SPEC = P(None, None, None, TP_AXIS, None)  # [L, num_blocks, block_size, Hkv, D]
HEADS_SPEC = P(None, TP_AXIS, None)  # q / k / v / attention output [T, heads, D]

# given the model's config (validated), the sharding of parameter `name` of this shape
ShardingRule = Callable[[ModelConfig], Callable[[str, tuple], NamedSharding]]


def check_divisible(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Heads are the unit of work per device: both head counts must divide by N."""
    n = tensor_parallel_size
    bad = [f"{name}={value}" for name, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads))
           if value % n]
    if bad:
        sizes = [d for d in range(1, cfg.num_kv_heads + 1) if cfg.num_kv_heads % d == 0 and cfg.num_heads % d == 0]
        raise ValueError(f"tensor_parallel_size={n} must divide the model's head counts, but {' and '.join(bad)} "
                         f"{'does' if len(bad) == 1 else 'do'} not divide by {n}; sizes that work for this model: "
                         f"{sizes}")


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh over the first N devices (all processes' devices under multi-host)."""
    devices = jax.devices()
    n = tensor_parallel_size
    if len(devices) < n:
        platform = devices[0].platform
        hint = (" On CPU, force more devices before JAX starts: jax.config.update('jax_num_cpu_devices', N) "
                "or XLA_FLAGS=--xla_force_host_platform_device_count=N." if platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={n} needs {n} devices, but JAX sees only {len(devices)} "
                         f"({platform}).{hint}")
    if jax.process_count() > 1 and n != len(devices):  # every process must own part of the mesh
        raise ValueError(f"with {jax.process_count()} processes the mesh must span all {len(devices)} devices: "
                         f"set tensor_parallel_size={len(devices)} (got {n})")
    return jax.make_mesh((n,), (TP_AXIS,), axis_types=(AxisType.Auto,), devices=devices[:n])


def param_spec(name: str, shape: tuple, n: int) -> P:
    """The PartitionSpec of parameter `name` (a key of the layout in paged_jax.model.llama)."""
    def split(axis: int) -> P:
        axis %= len(shape)
        if shape[axis] % n:
            return P()  # not divisible (vocabulary, MLP width): replicated, still correct
        return P(*(TP_AXIS if i == axis else None for i in range(len(shape))))

    if name in COLUMN_PARALLEL:
        return split(-1)
    if name in ROW_PARALLEL:
        return split(-2)
    if name == "embed":  # [V, H]
        return split(0) if shape[0] % n == 0 else split(1)
    if name == "lm_head":  # [H, V]
        return split(1) if shape[1] % n == 0 else split(0)
    return P()  # norms, bo


def sharding_rule(mesh: Mesh) -> ShardingRule:
    """For `load_model(..., shardings=...)`: checks the head counts once the config is
    known (before any tensor is read), then names each parameter's NamedSharding."""
    n = mesh.shape[TP_AXIS]

    def for_config(cfg: ModelConfig):
        check_divisible(cfg, n)
        return lambda name, shape: NamedSharding(mesh, param_spec(name, tuple(shape), n))

    return for_config


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Host array -> global array, each device receiving only its own shard (under
    multi-host, each process transfers only its devices' shards)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def load_sharded(model, dtype: str, mesh: Mesh):
    """A LoadedModel with its parameters placed over `mesh`: loaded shard by shard from a
    name or path, or re-placed leaf by leaf (through the host) when already loaded."""
    from paged_jax.loading import LoadedModel, load_model
    from paged_jax.loading.placement import place_params
    if not isinstance(model, LoadedModel):
        return load_model(model, dtype=dtype, shardings=sharding_rule(mesh))
    host = jax.tree.map(np.asarray, model.params)
    return dataclasses.replace(model, params=place_params(host, sharding_rule(mesh)(model.config)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, CACHE_SPEC)


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, mesh: Mesh) -> dict:
    """The zero cache, created sharded: each device allocates only its own heads."""
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    zeros = jax.jit(lambda: {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)},
                    out_shardings=cache_sharding(mesh))
    return zeros()


def sharded_attention(attention_fn, mesh: Mesh):
    """The model's attention_fn, run per shard: q/k/v and the cache split by head, the
    layer index and the paged metadata replicated. Same signature as attention_fn."""
    def run(q, k, v, kv_cache, layer, metadata):
        per_shard = jax.shard_map(attention_fn, mesh=mesh, in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, CACHE_SPEC,
                                                                     P(), P()),
                                  out_specs=(HEADS_SPEC, CACHE_SPEC), check_vma=False)
        return per_shard(q, k, v, kv_cache, layer, metadata)

    return run


def gather_logits(logits: jax.Array, vocab_size: int, mesh: Mesh) -> jax.Array:
    """f32[S, V] -> the same, whole on every device (sampling then runs replicated).

    Pinned vocab-sharded first: with only "replicated" XLA may propagate that back into
    the head matmul and all-gather the [H, V] head weight every step (it did, measured
    on the compiled HLO) instead of the much smaller [S, V] logits.
    """
    if vocab_size % mesh.shape[TP_AXIS] == 0:
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, TP_AXIS)))
    return jax.lax.with_sharding_constraint(logits, replicated(mesh))


def per_device_bytes(tree, device=None) -> int:
    """Bytes of `tree`'s arrays held on one device (default: the first addressable)."""
    leaves = jax.tree.leaves(tree)
    device = device or leaves[0].addressable_shards[0].device
    return sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == device)


def jit_kwargs(mesh: Mesh, params: Params) -> dict:
    """in/out shardings for the runner's step (StepModel.step): params as placed, cache by
    head, everything else replicated in (batch, rope tables, packed head, logits buffer,
    token feed) and out (the cache keeps its sharding, so donation aliases it and no step
    reshards). The step's outputs: logits, cache, hidden states, the head kernel's argmax
    (None under a mesh, which never packs the head) and the token feed."""
    rep = replicated(mesh)
    return {"in_shardings": (jax.tree.map(lambda a: a.sharding, params), cache_sharding(mesh), rep, rep, rep, rep,
                             rep),
            "out_shardings": (rep, cache_sharding(mesh), rep, rep, rep)}

