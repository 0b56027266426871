"""Host parameters -> device arrays, whole on one device or shard by shard.

Loaders build every parameter in host memory (numpy) and call `place_params` last. With
no sharding rule each array goes whole to the default device (the single-device path);
with one (tensor parallelism, `paged_jax.distributed.tensor_parallel.sharding_rule`) each device
receives only its own slice, so the model is never whole on one device, and under
multi-host each process transfers only its own devices' slices.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from paged_jax.model.llama import Params

# parameter name (a key of paged_jax.model.llama's layout) and shape -> its jax.sharding.Sharding
ShardingOf = Callable[[str, tuple], jax.sharding.Sharding]


def place_params(host_params: Params, sharding_of: ShardingOf | None = None) -> Params:
    if sharding_of is None:
        return jax.tree.map(jnp.asarray, host_params)

    def one(path, host):
        return jax.make_array_from_callback(host.shape, sharding_of(path[-1].key, host.shape),
                                            lambda index: host[index])

    return jax.tree_util.tree_map_with_path(one, host_params)
