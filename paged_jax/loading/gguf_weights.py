"""Load a GGUF file (llama.cpp's format) into a `ModelConfig` and our parameter pytree.

A GGUF carries both the hyperparameters (as `{arch}.*` metadata) and the tensors, often
block-quantized (Q4_1, Q8_0, ...). We dequantize every tensor to float32 in numpy with
the `gguf` package and cast once to the requested dtype: the model then runs on plain
dense weights, so any quantization llama.cpp can write loads, and the numbers equal
what `transformers` gets from the same file.

Three differences from Hugging Face's layout are undone here:
  * GGUF lists dimensions fastest-first, so a tensor's numpy shape is its GGUF shape
    reversed; for a linear layer that is HF's [out, in], which we transpose to [in, out].
  * llama.cpp's converter permutes the rows of q and k (weights and biases) of llama and
    mistral models so that its RoPE can rotate adjacent pairs (2i, 2i+1); our RoPE
    (like HF's) rotates i with i + head_dim/2, so we invert that permutation. Qwen2 and
    Qwen3 are converted unpermuted (llama.cpp uses NEOX-style RoPE for them).
  * Per-layer tensors are stacked on a leading `num_layers` axis (see `model.py`).

A truncated or corrupt file is a WeightFileError naming it (loading/errors.py), not the
numpy reshape or index error gguf's reader raises on a short memory map.
"""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from paged_jax.config.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from paged_jax.loading.errors import WeightFileError, detail, file_size
from paged_jax.loading.gguf_dequant import dequantize
from paged_jax.loading.gguf_file import GGUFFile
from paged_jax.loading.placement import place_params
from paged_jax.model.llama import Params, param_shapes
from paged_jax.model.rope import inverse_frequencies

# Architectures whose q/k rows llama.cpp's converter interleaved for its rotate-pairs RoPE.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

# GGUF tensor name -> (our parameter name, transpose from HF [out, in] to [in, out]).
_GLOBAL_TENSORS = {
    "token_embd.weight": ("embed", False),
    "output_norm.weight": ("final_norm", False),
    "output.weight": ("lm_head", True),
}
_LAYER_TENSORS = {  # names after the "blk.{i}." prefix
    "attn_norm.weight": ("attn_norm", False), "ffn_norm.weight": ("mlp_norm", False),
    "attn_q.weight": ("wq", True), "attn_k.weight": ("wk", True), "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False), "attn_k.bias": ("bk", False), "attn_v.bias": ("bv", False),
    "attn_output.bias": ("bo", False),
    "attn_q_norm.weight": ("q_norm", False), "attn_k_norm.weight": ("k_norm", False),
    "ffn_gate.weight": ("w_gate", True), "ffn_up.weight": ("w_up", True), "ffn_down.weight": ("w_down", True),
}
# Tensors that are metadata rather than parameters (read into the config instead).
_NON_PARAMETER_TENSORS = ("rope_freqs.weight",)
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED = object()
# What parsing a file that ends early or holds garbage raises (the header: ValueError,
# UnicodeDecodeError; dequantizing a tensor whose bytes do not fit its type: numpy's errors).
_READER_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, EOFError)


def open_gguf(path: str) -> GGUFFile:
    """The GGUF at `path`, its header parsed; a truncated or corrupt file raises
    WeightFileError naming it."""
    try:
        return GGUFFile(path)
    except OSError as err:
        raise WeightFileError(path, f"the file cannot be read ({detail(err)})") from err
    except _READER_ERRORS as err:
        raise WeightFileError(path, f"the GGUF file ({file_size(path)}) is truncated or corrupt: its header "
                                    f"does not parse ({detail(err)})") from err


def _f32_value(value: float) -> float:
    """The shortest decimal that a float32 metadata value rounds from (9.99999975e-06 -> 1e-05).

    GGUF stores floats as float32; the configs they came from were written in decimal.
    """
    return float(str(np.float32(value)))


def _dequantized(tensor) -> np.ndarray:
    """f32 array in numpy (row-major) order: GGUF's shape reversed."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute` on q/k rows (weights [rows, in] or biases [rows]).

    llama.cpp stores, within each head of D rows, HF row j*D/2 + i at row 2i + j (j in
    {0, 1}); reading rows as [head, i, j] and swapping to [head, j, i] restores HF order.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(reader: GGUFFile, field, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    """RoPE scaling from `{arch}.rope.scaling.*`, or Llama 3's `rope_freqs` tensor.

    llama.cpp stores Llama 3.1 scaling only as per-frequency divisors, not as its four
    parameters. We take `factor` as the largest divisor, assume Llama 3's published
    low/high frequency factors (1, 4), and accept them only if they reproduce every
    divisor: a file they do not fit is refused rather than run with wrong positions.
    """
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        divisors = _dequantized(freqs).reshape(-1)
        if np.all(divisors == 1.0):
            return None
        scaling = RopeScaling("llama3", factor=_f32_value(divisors.max()), original_max_position_embeddings=int(
            field(f"{arch}.rope.scaling.original_context_length", 8192)))
        expected = inverse_frequencies(head_dim, theta, None) / divisors if divisors.shape == (head_dim // 2,) else None
        if expected is None or not np.allclose(inverse_frequencies(head_dim, theta, scaling), expected, rtol=1e-5):
            raise ValueError("the GGUF's rope_freqs tensor does not match llama3 RoPE scaling with "
                             "low_freq_factor=1, high_freq_factor=4; other per-frequency scalings are unsupported")
        return scaling
    kind = field(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=_f32_value(field(f"{arch}.rope.scaling.factor")))
    raise ValueError(f"unsupported RoPE scaling {kind!r} in the GGUF; supported: linear, llama3, none")


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes (architecture checked first)."""

    def field(key: str, default=_REQUIRED):
        if key in reader.fields:
            return reader.fields[key]
        if default is _REQUIRED:
            raise ValueError(f"the GGUF lacks the metadata key {key!r}")
        return default

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("the GGUF has no token_embd.weight tensor")
    hidden_size, num_heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", 0)) or hidden_size // num_heads
    theta = _f32_value(field(f"{arch}.rope.freq_base", 10000.0))
    eos = [field(f"tokenizer.ggml.{name}_token_id", None) for name in ("eos", "eot", "eom")]
    sliding_window = field(f"{arch}.attention.sliding_window", None)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF shape [H, V]
        hidden_size=hidden_size,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32_value(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, field, arch, head_dim, theta),
        max_position_embeddings=int(field(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=field("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(t) for t in eos if t is not None)),
    )


def load_gguf(path: str, dtype=jnp.float32, shardings=None, reader: GGUFFile | None = None,
              ) -> tuple[ModelConfig, Params]:
    """Read a GGUF file: (config, params) with params in `model.py`'s layout, cast to dtype.

    `shardings(config)` -> (name, shape) -> Sharding (optional, tensor parallelism): the
    config is checked against it before any tensor is read, and each device gets only its
    slices (loading/placement.py).

    Every expected parameter must be present exactly with the shape the metadata
    implies; an unknown tensor name or a missing one is an error, not silently skipped.
    `reader`: the file already opened (`open_gguf(path)`), so a caller that also builds the
    tokenizer parses the header once.
    """
    reader = reader if reader is not None else open_gguf(path)
    cfg = gguf_config(reader)
    sharding_of = shardings(cfg) if shardings is not None else None
    shapes = param_shapes(cfg)
    np_dtype = np.dtype(dtype)  # bfloat16 too, through ml_dtypes
    params = {name: np.empty(shape, np_dtype) for name, shape in shapes.items() if name != "layers"}
    params["layers"] = {name: np.empty(shape, np_dtype) for name, shape in shapes["layers"].items()}
    missing = {(name, None) for name in params if name != "layers"} | {
        (name, layer) for name in params["layers"] for layer in range(cfg.num_layers)}
    unpermute = cfg.architecture in _PERMUTED_ARCHITECTURES

    for tensor in tqdm(reader.tensors, desc=f"loading {os.path.basename(path)}", unit="tensor", disable=None):
        match = _LAYER_NAME.fullmatch(tensor.name)
        if tensor.name in _NON_PARAMETER_TENSORS:
            continue
        if match and match.group(2) in _LAYER_TENSORS:
            (name, transpose), layer = _LAYER_TENSORS[match.group(2)], int(match.group(1))
        elif tensor.name in _GLOBAL_TENSORS:
            (name, transpose), layer = _GLOBAL_TENSORS[tensor.name], None
        else:
            raise ValueError(f"unexpected tensor {tensor.name!r} in a {cfg.architecture} GGUF")
        if (name, layer) not in missing:
            raise ValueError(f"tensor {tensor.name!r} is duplicated or outside the {cfg.num_layers} layers")
        try:
            w = _dequantized(tensor)
        except _READER_ERRORS as err:  # its bytes do not make the shape and type the header says
            raise WeightFileError(path, f"tensor {tensor.name!r} is corrupt: {detail(err)}") from err
        if unpermute and name in ("wq", "bq"):
            w = _unpermute_rows(w, cfg.num_heads)
        elif unpermute and name in ("wk", "bk"):
            w = _unpermute_rows(w, cfg.num_kv_heads)
        if transpose:
            w = w.T
        dest = params[name] if layer is None else params["layers"][name][layer]
        if w.shape != dest.shape:
            raise ValueError(f"tensor {tensor.name!r} has shape {w.shape}; the metadata implies {dest.shape}")
        dest[...] = w
        missing.discard((name, layer))

    if missing:
        raise ValueError(f"the GGUF lacks {len(missing)} parameters, e.g. {sorted(missing, key=str)[:3]}")
    return cfg, place_params(params, sharding_of)
