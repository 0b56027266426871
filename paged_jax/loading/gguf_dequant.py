"""Dequantize whole GGUF tensors at once, for the block types the registered models use.

Why not only `gguf.quants.dequantize`: it splits a tensor into groups of 16 rows, builds
each group's result in temporaries and concatenates them; for SmolLM2-135M's Q4_1 and
Q8_0 tensors that was 0.95 s of CPU per load, the largest part of reading the file. Here
each tensor is one pass of numpy over its blocks, written into one f32 array. The
arithmetic is gguf's, operation for operation (f16 scales widened to f32, then
`d * q + m` for Q4_1 and `q * d` for Q8_0, each rounded in f32), so the values are bit
for bit the same (tests/loading/test_gguf_dequant.py); every other type goes to gguf.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize


def _blocks(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """The tensor's bytes as u8[num_blocks, block bytes]."""
    _, type_bytes = GGML_QUANT_SIZES[kind]
    flat = np.ascontiguousarray(data).reshape(-1)
    if flat.dtype != np.uint8 or flat.size % type_bytes:
        raise ValueError(f"{kind.name} data must be uint8 whole blocks of {type_bytes} bytes, got {data.dtype} "
                         f"{data.shape}")
    return flat.reshape(-1, type_bytes)


def _f16_column(blocks: np.ndarray, start: int) -> np.ndarray:
    """f32[num_blocks, 1]: the f16 scale at byte `start` of each block."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # block: f16 d, f16 m, 16 bytes of nibbles: the low ones are values 0-15, the high ones 16-31
    d, m, qs = _f16_column(blocks, 0), _f16_column(blocks, 2), blocks[:, 4:]
    out = np.empty((len(blocks), 32), np.float32)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :16], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=out[:, 16:], casting="unsafe")
    out *= d
    out += m
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # block: f16 d, 32 int8 values
    d = _f16_column(blocks, 0)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= d
    return out


_FAST = {GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q8_0: _q8_0}


def dequantize(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """f32 values of a tensor's data as GGUFFile gives it (quantized types: u8[..., row
    bytes]), shaped [..., row elements]; the same values as `gguf.quants.dequantize`."""
    fast = _FAST.get(kind)
    if fast is None:
        return np.asarray(gguf_dequantize(data, kind), np.float32)
    block, type_bytes = GGML_QUANT_SIZES[kind]
    if data.ndim < 1 or data.shape[-1] % type_bytes:
        raise ValueError(f"{kind.name} rows must be whole blocks of {type_bytes} bytes, got shape {data.shape}")
    return fast(_blocks(data, kind)).reshape(*data.shape[:-1], data.shape[-1] // type_bytes * block)
