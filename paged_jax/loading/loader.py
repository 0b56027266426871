"""One entry point for every weight source: `load_model("smollm2-135m")`.

Accepts a registered name, a GGUF file, a Hugging Face directory (config.json +
safetensors + tokenizer files), a paged_jax orbax checkpoint, or a Hugging Face Hub id
(`Qwen/Qwen3-0.6B`: its snapshot directory in the Hub cache, hub.py), and always returns the
same three things: a ModelConfig, a parameter pytree in paged_jax's layout, and a
`transformers` tokenizer (with the model's chat template when it has one).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config.model_config import ModelConfig
from paged_jax.loading import checkpoint, hub, registry
from paged_jax.model.llama import Params

SUPPORTED_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What the engine serves. `model_class` is how a researcher's own Flax NNX decoder
    plugs in without editing the package: a class taking (cfg, *, rngs, dtype=...) whose
    nnx.Param state, as a pure dict, has exactly `params`' names and shapes (the runner
    checks), e.g. `dataclasses.replace(loaded, model_class=MyDecoder, params=my_params)`
    and then `LLM(that)`. None: the built-in `paged_jax.model.decoder.LlamaDecoder`.
    Loaders never set it: files hold weights, not code."""

    config: ModelConfig
    params: Params
    tokenizer: Any  # transformers.PreTrainedTokenizerBase, or None (checkpoint saved without one)
    source: str  # the file or directory the weights came from
    kind: str  # "gguf" | "hf" | "checkpoint"
    load_seconds: float  # wall time of the load, for the record
    model_class: type | None = None  # a paged_jax.model.decoder.LlamaDecoder-like nnx.Module class


def resolve_dtype(dtype) -> jnp.dtype:
    name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {list(SUPPORTED_DTYPES)}")
    return jnp.dtype(name)


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def detect_kind(path: str) -> str:
    """Which loader reads `path`: "gguf", "hf" or "checkpoint"; ValueError otherwise."""
    if os.path.isfile(path) and _is_gguf(path):
        return "gguf"
    if os.path.isdir(path) and checkpoint.is_checkpoint(path):
        return "checkpoint"
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    what = "does not exist" if not os.path.exists(path) else (
        "is a file without the GGUF magic bytes" if os.path.isfile(path) else
        "is a directory with neither config.json nor " + checkpoint.MARKER)
    raise ValueError(f"cannot load model from {path!r}: it {what}. Expected {registry.accepted_sources()}")


def locate(model: str) -> str:
    """The file or directory `model` names, in this order: a registered name's GGUF file;
    an existing file or directory, as given (a local `owner/name` directory wins over the
    Hub, as in vLLM); a Hub id's snapshot directory (downloaded when online). A bare
    unknown name gets the registry's error (its registered names); anything else that
    exists nowhere, the reason it is not a Hub id and every accepted form."""
    if model in registry.REGISTRY or (os.sep not in model and "/" not in model and not os.path.exists(model)):
        return registry.resolve(model)
    if os.path.exists(model):
        return model
    problem = hub.hub_id_problem(model)
    if problem is not None:
        raise ValueError(f"cannot load model from {model!r}: it does not exist as a file or directory, and it is "
                         f"not a Hugging Face Hub id ({problem}). Expected {registry.accepted_sources()}")
    return hub.resolve(model)


def load_model(model: str = registry.DEFAULT_MODEL, *, dtype="float32", shardings=None) -> LoadedModel:
    """Load weights, config and tokenizer from any supported source (see module doc).

    `shardings`: None (every parameter whole on the default device) or a rule
    config -> (name, shape) -> Sharding, e.g. `tensor_parallel.sharding_rule(mesh)`:
    parameters are then placed shard by shard, never whole on one device."""
    start = time.perf_counter()
    target = resolve_dtype(dtype)
    path = locate(model)
    kind = detect_kind(path)
    if kind == "gguf":
        from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
        from paged_jax.loading.gguf_weights import load_gguf, open_gguf
        reader = open_gguf(path)  # the header once for both (SmolLM2's vocabulary and merges: ~0.35 s a parse)
        cfg, params = load_gguf(path, dtype=target, shardings=shardings, reader=reader)
        tokenizer = load_gguf_tokenizer(path, reader=reader)
    elif kind == "hf":
        from paged_jax.loading.hf_tokenizer import has_tokenizer, load_hf_tokenizer
        from paged_jax.loading.hf_weights import load_hf_directory
        cfg, params = load_hf_directory(path, dtype=target, shardings=shardings)
        tokenizer = load_hf_tokenizer(path) if has_tokenizer(path) else None
    else:
        cfg, params, tokenizer = checkpoint.load_checkpoint(path, shardings=shardings)
        if params["embed"].dtype != target:
            params = jax.tree.map(lambda a: a.astype(target), params)
    return LoadedModel(cfg, params, tokenizer, os.path.abspath(path), kind, time.perf_counter() - start)

