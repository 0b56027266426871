"""Memory per device under tensor parallelism: parameters and KV cache at N = 1 and N > 1.

    python -m experiments.tensor_parallel_memory                          # SmolLM2-135M at 1 and 3
    python -m experiments.tensor_parallel_memory --model=tiny_llama_tp4 --tensor_parallel_sizes=1,2,4

Why: tensor parallelism exists for models and caches that outgrow one device, so each
device must hold ~1/N of the parameters (norms are replicated: a rounding error) and,
at a given number of blocks, 1/N of the KV cache; a per-device KV budget then buys N
times the blocks. The figures are measured from the placed arrays themselves (the bytes
of each device's shards, as `load_model(..., shardings=...)` and the runner's cache
initializer place them), on --num_cpu_devices forced CPU devices, or real devices.
`--model` is any load_model source, or a configs/ preset name (random weights).
"""

from __future__ import annotations

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "load_model source, or a configs/ preset (random weights).")
_SIZES = flags.DEFINE_list("tensor_parallel_sizes", ["1", "3"], "Mesh sizes to measure; must divide the heads.")
_NUM_CPU_DEVICES = flags.DEFINE_integer("num_cpu_devices", 4, "CPU only: devices to force (jax_num_cpu_devices); "
                                        "0 leaves the platform's devices as they are.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 256, "KV blocks per device for the per-device cache figure.")
_KV_BUDGET = flags.DEFINE_integer("kv_cache_memory_bytes", 512 * 2**20,
                                  "Per-device KV budget for the blocks-per-budget figure.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and cache dtype.")


def _load(model: str, dtype: str, mesh):
    import configs
    from experiments.bench_models import random_model
    from paged_jax.distributed import tensor_parallel as tp
    from paged_jax.loading import load_model
    if model in configs.PRESETS:
        loaded = random_model(model, dtype=dtype, source=model)
        return loaded if mesh is None else tp.load_sharded(loaded, dtype, mesh)
    if mesh is None:
        return load_model(model, dtype=dtype)
    return tp.load_sharded(model, dtype, mesh)


def _measure(size: int) -> dict:
    import jax

    from paged_jax.worker import kv_cache as kvc
    from paged_jax.distributed import tensor_parallel as tp
    from paged_jax.engine.llm_engine import _resolve
    from paged_jax.config.engine_config import EngineConfig
    mesh = tp.make_mesh(size) if size > 1 else None
    loaded = _load(_MODEL.value, _DTYPE.value, mesh)
    cfg = loaded.config
    if mesh is None:
        cache = kvc.init_kv_cache(cfg, _NUM_BLOCKS.value, _BLOCK_SIZE.value, _DTYPE.value)
    else:
        cache = tp.init_kv_cache(cfg, _NUM_BLOCKS.value, _BLOCK_SIZE.value, _DTYPE.value, mesh)
    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    params = [tp.per_device_bytes(loaded.params, d) for d in devices]
    kv = [tp.per_device_bytes(cache, d) for d in devices]
    budget = EngineConfig(block_size=_BLOCK_SIZE.value, kv_cache_memory_bytes=_KV_BUDGET.value,
                          tensor_parallel_size=size, dtype=_DTYPE.value)
    return {"tensor_parallel_size": size, "param_bytes_per_device": params, "kv_bytes_per_device": kv,
            "param_bytes_total": sum(a.nbytes for a in jax.tree.leaves(loaded.params)),
            "num_blocks_per_budget": _resolve(budget, loaded).num_blocks, "load_seconds": loaded.load_seconds}


def main(argv):
    del argv
    import jax
    if _NUM_CPU_DEVICES.value:
        jax.config.update("jax_num_cpu_devices", _NUM_CPU_DEVICES.value)
    from experiments.reporting.results_io import write_result
    runs = [_measure(int(s)) for s in _SIZES.value]
    base = runs[0]
    for run in runs:
        n = run["tensor_parallel_size"]
        run["param_fraction_of_first"] = max(run["param_bytes_per_device"]) / max(base["param_bytes_per_device"])
        run["kv_fraction_of_first"] = max(run["kv_bytes_per_device"]) / max(base["kv_bytes_per_device"])
        run["ideal_fraction"] = base["tensor_parallel_size"] / n
        print(f"N={n}: params/device {max(run['param_bytes_per_device']) / 2**20:.2f} MiB "
              f"({run['param_fraction_of_first']:.4f} of N={base['tensor_parallel_size']}, ideal "
              f"{run['ideal_fraction']:.4f}); KV/device at {_NUM_BLOCKS.value} blocks "
              f"{max(run['kv_bytes_per_device']) / 2**20:.2f} MiB ({run['kv_fraction_of_first']:.4f}); "
              f"blocks per {_KV_BUDGET.value / 2**20:.0f} MiB/device budget: {run['num_blocks_per_budget']}")
    path = write_result("tensor_parallel_memory", flags={k: flags.FLAGS[k].value for k in (
        "model", "tensor_parallel_sizes", "num_cpu_devices", "block_size", "num_blocks", "kv_cache_memory_bytes",
        "dtype")}, figures={  # summary scalars first (the results table shows them): largest N vs the first
        "tensor_parallel_size": runs[-1]["tensor_parallel_size"],
        "param_bytes_per_device_fraction": round(runs[-1]["param_fraction_of_first"], 4),
        "kv_bytes_per_device_fraction": round(runs[-1]["kv_fraction_of_first"], 4),
        "ideal_fraction": round(runs[-1]["ideal_fraction"], 4), "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    flags.FLAGS.set_default("verbosity", -1)
    app.run(main)
