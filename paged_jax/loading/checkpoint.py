"""Converted-parameter checkpoints with orbax: convert a GGUF or HF model once, load fast.

A checkpoint directory holds
    paged_jax_model.json   the ModelConfig and the parameter dtype
    params/                the parameter pytree, written by orbax (OCDBT, zarr v2)
    tokenizer/             the tokenizer, as `save_pretrained` writes it
Restoring passes orbax the exact shapes and dtypes (from the config), so nothing is
re-derived and the parameters come back bit-identical, straight onto the default device.
Zarr v2 restored faster than orbax's zarr3 default on 2 CPU cores
(experiments/load_times.py records the times).

A checkpoint that was cut short (a copy that ran out of disk, a sync that stopped) fails
to load with a WeightFileError naming the file or directory and what is wrong, not with
a JSON error or TensorStore's page-long spec: the marker is read and checked field by
field, and any failure of orbax's restore is reported as a damaged params/ directory.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config.model_config import ModelConfig, RopeScaling
from paged_jax.loading.errors import WeightFileError, detail
from paged_jax.model.llama import Params, param_shapes

MARKER = "paged_jax_model.json"
FORMAT_VERSION = 1


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    return ModelConfig(**data)


def _orbax():
    import orbax.checkpoint as ocp  # imported lazily: orbax pulls in a lot at import time
    return ocp, ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=False))


def save_checkpoint(path: str, cfg: ModelConfig, params: Params, tokenizer=None) -> None:
    """Write a checkpoint to directory `path` (created; must not already hold one)."""
    path = os.path.abspath(path)
    if is_checkpoint(path):
        raise ValueError(f"{path} already holds a paged_jax checkpoint; choose a new directory")
    os.makedirs(path, exist_ok=True)
    dtype = jnp.dtype(params["embed"].dtype).name
    ocp, ckpt = _orbax()
    with ckpt:
        ckpt.save(os.path.join(path, "params"), args=ocp.args.PyTreeSave(params))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(path, "tokenizer"))
    with open(os.path.join(path, MARKER), "w") as f:  # written last: marks a complete checkpoint
        json.dump({"format_version": FORMAT_VERSION, "dtype": dtype, "config": config_to_dict(cfg)}, f, indent=1)


def load_checkpoint(path: str, *, load_tokenizer: bool = True, shardings=None) -> tuple[ModelConfig, Params, object]:
    """Restore (config, params, tokenizer or None) from a directory `save_checkpoint` wrote.
    `shardings` (as in `load_gguf`): orbax restores each device's slices directly."""
    path = os.path.abspath(path)
    if not is_checkpoint(path):
        raise ValueError(f"{path} is not a paged_jax checkpoint (no {MARKER})")
    cfg, dtype = _read_marker(os.path.join(path, MARKER))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharding_of = shardings(cfg) if shardings is not None else (lambda name, shape: device)
    abstract = jax.tree_util.tree_map_with_path(
        lambda p, shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(p[-1].key, shape)),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    ocp, ckpt = _orbax()
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=dtype), abstract)
    params_dir = os.path.join(path, "params")
    if not os.path.isdir(params_dir):
        raise WeightFileError(path, f"the checkpoint has no params/ directory (its {MARKER} is there): it was "
                                    "not copied completely")
    try:
        with ckpt:
            params = ckpt.restore(params_dir, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
    except Exception as err:  # orbax and tensorstore raise plain Exception, ValueError, JSON errors, ...
        raise WeightFileError(params_dir, "orbax could not restore the parameters from it: is a file in it "
                                          f"truncated, missing or corrupt? ({detail(err)})") from err
    tokenizer = None
    tokenizer_dir = os.path.join(path, "tokenizer")
    if load_tokenizer and os.path.isdir(tokenizer_dir):
        from paged_jax.loading.hf_tokenizer import load_hf_tokenizer
        tokenizer = load_hf_tokenizer(tokenizer_dir)
    return cfg, params, tokenizer


def _read_marker(marker: str) -> tuple[ModelConfig, np.dtype]:
    """The config and parameter dtype a checkpoint's marker file records."""
    try:
        with open(marker) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise WeightFileError(marker, f"not valid JSON ({detail(err)}); it is truncated or corrupt") from err
    if not isinstance(meta, dict):
        raise WeightFileError(marker, f"expected a JSON object, got {type(meta).__name__}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {meta.get('format_version')} is not supported "
                         f"(this paged_jax reads format {FORMAT_VERSION})")
    try:
        return config_from_dict(meta["config"]), np.dtype(jnp.dtype(meta["dtype"]))
    except (KeyError, TypeError, ValueError) as err:
        raise WeightFileError(marker, f"does not describe a model ({detail(err)}): it is corrupt, or was "
                                      "written by another version of paged_jax") from err
