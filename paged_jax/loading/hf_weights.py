"""Load a Hugging Face model directory (`save_pretrained` output) into our parameter layout.

The directory holds `config.json` and safetensors weights, either one
`model.safetensors` or shards listed in `model.safetensors.index.json`. Tensors are read
with safetensors' numpy backend (no torch at runtime), each Linear weight is transposed
from torch's [out, in] to our [in, out], per-layer tensors are stacked on a leading
layer axis (see `paged_jax.model.llama`), and everything is cast to the requested dtype on
the host, one tensor at a time, before moving to the device.

The set of tensor names must match the config exactly: a missing tensor or an
unexpected one (a bias the config does not declare, an extra layer) is an error that
lists them, never silently ignored or zero-filled. Two exceptions, as in transformers:
rotary `inv_freq` buffers that old checkpoints saved are ignored, and a checkpoint
without `lm_head.weight` uses the embedding matrix as its output projection.

A truncated or corrupt file (a shard cut off mid-download, a garbled header) is a
WeightFileError naming that file (loading/errors.py), never safetensors' bare error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from paged_jax.config.model_config import ModelConfig
from paged_jax.loading.errors import WeightFileError, detail, file_size
from paged_jax.loading.hf_config import config_from_hf
from paged_jax.loading.placement import place_params
from paged_jax.model.llama import Params, param_shapes

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Our per-layer parameter name -> (suffix after "model.layers.{i}.", transposed from [out, in]).
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Our top-level parameter name -> (Hugging Face name, transposed).
_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
_LM_HEAD = _TOP_NAMES["lm_head"][0]

# safetensors dtype codes we accept, as numpy dtypes (bf16 through ml_dtypes).
_FLOAT_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                 "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one Hugging Face tensor goes."""

    param: str  # top-level name, or a key of params["layers"]
    layer: int | None  # index on the stacked layer axis; None for top-level parameters
    transpose: bool  # torch Linear [out, in] -> [in, out]
    shape: tuple[int, ...]  # the tensor's shape in the file (before transposing)


def load_hf_directory(path: str, dtype=jnp.float32, shardings=None) -> tuple[ModelConfig, Params]:
    """Read a Hugging Face Llama/Mistral/Qwen2/Qwen3 directory into (config, params).

    `dtype` is the dtype of every returned parameter (a floating type; weights are cast
    on the host). The returned config says `tie_word_embeddings=True` whenever the
    params have no `lm_head`, so the two always agree. `shardings`: as in `load_gguf`.
    """
    target_dtype = np.dtype(jnp.dtype(dtype))
    if not jnp.issubdtype(target_dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type (float32, bfloat16, float16), got {target_dtype}")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        raise ValueError(f"{path!r} is not a Hugging Face model directory: expected a directory holding "
                         f"{CONFIG_FILE} and {SINGLE_FILE} (or {INDEX_FILE} with its shards)")
    with open(config_path) as f:
        try:
            cfg = config_from_hf(json.load(f))
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_path} is not valid JSON: {err}") from None

    files = _weight_files(path)
    available = _tensor_locations(files)
    if _LM_HEAD not in available and not cfg.tie_word_embeddings:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    sharding_of = shardings(cfg) if shardings is not None else None  # checks the config before reading
    targets = _targets(cfg)
    ignored = {n for n in available if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings and _LM_HEAD in available:
        ignored.add(_LM_HEAD)  # checked against the embedding below, then dropped
    missing = sorted(set(targets) - set(available))
    unexpected = sorted(set(available) - set(targets) - ignored)
    if missing or unexpected:
        raise ValueError(f"tensors in {path!r} do not match its config.json ({cfg.architecture}, "
                         f"{cfg.num_layers} layers): missing {missing}, unexpected {unexpected}")

    shapes = param_shapes(cfg)
    params: Params = {"layers": {}}
    for name, shape in shapes["layers"].items():
        params["layers"][name] = np.empty(shape, target_dtype)
    for name in _TOP_NAMES:
        if name in shapes:
            params[name] = None
    for file_path, names in _group_by_file({n: available[n] for n in targets}).items():
        with open_safetensors(file_path) as handle:
            for hf_name in names:
                target = targets[hf_name]
                tensor = _read_tensor(handle, file_path, hf_name)
                if tuple(tensor.shape) != target.shape:
                    raise ValueError(f"tensor {hf_name} in {file_path} has shape {tuple(tensor.shape)}; "
                                     f"the config implies {target.shape}")
                value = (tensor.T if target.transpose else tensor).astype(target_dtype)
                if target.layer is None:
                    params[target.param] = np.ascontiguousarray(value)
                else:
                    params["layers"][target.param][target.layer] = value
    if cfg.tie_word_embeddings and _LM_HEAD in available:
        _check_tied_head(available)
    return cfg, place_params(params, sharding_of)


def _weight_files(path: str) -> list[str]:
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
                raise WeightFileError(index_path, f"the shard index is not a JSON object ({detail(err)}); it is "
                                                  "truncated or corrupt") from err
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map' naming the shard of each tensor")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"{index_path} lists shards that do not exist: {absent}")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".gguf")))
    raise ValueError(f"{path!r} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors weights are "
                     f"supported" + (f" (found {others})" if others else ""))


def _tensor_locations(files: list[str]) -> dict[str, str]:
    """Tensor name -> the file holding it, from the files' own headers."""
    locations: dict[str, str] = {}
    for file_path in files:
        with open_safetensors(file_path) as handle:
            for name in handle.keys():
                if name in locations:
                    raise ValueError(f"tensor {name} appears in both {locations[name]} and {file_path}")
                locations[name] = file_path
    return locations


@contextlib.contextmanager
def open_safetensors(file_path: str):
    """safe_open(file_path) for numpy; a truncated or corrupt file raises WeightFileError
    naming it. safetensors checks the header when it opens a file (the JSON, and that the
    tensors' byte ranges exactly cover the rest of the file), so a cut-off download fails
    here, before any tensor is read."""
    try:
        handle = safe_open(file_path, framework="numpy")
    except OSError as err:
        raise WeightFileError(file_path, f"the file cannot be read ({detail(err)})") from err
    except SafetensorError as err:
        raise WeightFileError(file_path, f"the safetensors file ({file_size(file_path)}) is truncated or corrupt: "
                                         f"{detail(err)}") from err
    with handle as opened:
        yield opened


def _group_by_file(locations: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name, file_path in sorted(locations.items()):
        grouped.setdefault(file_path, []).append(name)
    return grouped


def _targets(cfg: ModelConfig) -> dict[str, _Target]:
    """Every Hugging Face tensor name the config implies, with its destination."""
    shapes = param_shapes(cfg)
    targets = {}
    for param, (hf_name, transpose) in _TOP_NAMES.items():
        if param in shapes:
            targets[hf_name] = _Target(param, None, transpose, _file_shape(shapes[param], transpose))
    for param, stacked in shapes["layers"].items():
        suffix, transpose = _LAYER_NAMES[param]
        for layer in range(cfg.num_layers):
            targets[f"model.layers.{layer}.{suffix}"] = _Target(
                param, layer, transpose, _file_shape(stacked[1:], transpose))
    return targets


def _file_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transpose else tuple(shape)


def _read_tensor(handle, file_path: str, name: str) -> np.ndarray:
    """One tensor as numpy. Falls back to reading raw bytes when this safetensors build's
    numpy backend cannot produce the dtype (bfloat16 on some versions)."""
    try:
        tensor = handle.get_tensor(name)
    except (TypeError, ValueError):
        tensor = None
    except SafetensorError as err:
        raise WeightFileError(file_path, f"tensor {name} cannot be read: {detail(err)}") from err
    dtype_code = handle.get_slice(name).get_dtype()
    if dtype_code not in _FLOAT_DTYPES:
        raise ValueError(f"tensor {name} in {file_path} has dtype {dtype_code}; supported: "
                         f"{sorted(_FLOAT_DTYPES)}")
    if tensor is None or tensor.dtype != _FLOAT_DTYPES[dtype_code]:
        tensor = read_raw_tensor(file_path, name)
    return tensor


def read_raw_tensor(file_path: str, name: str) -> np.ndarray:
    """Read tensor `name` straight from a safetensors file's bytes (header, then data).

    Layout: u64 little-endian header length N, N bytes of JSON mapping each name to
    {"dtype", "shape", "data_offsets": [begin, end]} (relative to the end of the header),
    then the little-endian row-major data.
    """
    with open(file_path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise WeightFileError(file_path, f"the safetensors header is not valid JSON ({detail(err)}); the file "
                                             f"({file_size(file_path)}) is truncated or corrupt") from err
        if name not in header:
            raise ValueError(f"tensor {name} is not in {file_path}")
        entry = header[name]
        if entry["dtype"] not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name} in {file_path} has dtype {entry['dtype']}; supported: "
                             f"{sorted(_FLOAT_DTYPES)}")
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    if len(data) != end - begin:
        raise WeightFileError(file_path, f"tensor {name} needs bytes {begin}..{end} after the header, but the file "
                                         f"({file_size(file_path)}) ends first: it is truncated")
    tensor = np.frombuffer(data, dtype=_FLOAT_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return tensor if sys.byteorder == "little" else tensor.byteswap()


def _check_tied_head(available: dict[str, str]) -> None:
    """A tied checkpoint that also stores lm_head must store the embedding there."""
    tensors = []
    for name in (_LM_HEAD, _TOP_NAMES["embed"][0]):
        with open_safetensors(available[name]) as handle:
            tensors.append(_read_tensor(handle, available[name], name))
    head, embed = tensors
    if head.shape != embed.shape or not np.array_equal(head.astype(np.float32), embed.astype(np.float32)):
        raise ValueError(f"config.json says tie_word_embeddings=true but {_LM_HEAD} differs from "
                         "model.embed_tokens.weight; set tie_word_embeddings=false to use it")
