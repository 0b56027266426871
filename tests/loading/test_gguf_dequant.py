"""paged_jax/loading/gguf_dequant.py gives gguf's dequantized values bit for bit."""

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from paged_jax.loading.gguf_dequant import dequantize
from paged_jax.loading.gguf_file import GGUFFile


def _random_blocks(rng, kind, rows: int, blocks_per_row: int) -> np.ndarray:
    """u8[rows, row bytes] of random blocks whose f16 scales are finite, of either sign."""
    _, type_bytes = GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, blocks_per_row, type_bytes), dtype=np.uint8)
    scales = 2 if kind == GGMLQuantizationType.Q4_1 else 1  # Q4_1: d and m
    data[..., : 2 * scales] = rng.normal(0, 0.05, (rows, blocks_per_row, scales)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, blocks_per_row * type_bytes)


def _assert_bit_equal(ours, theirs):
    theirs = np.asarray(theirs, np.float32)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_random_blocks_match_gguf(kind):
    rng = np.random.default_rng(3)
    data = _random_blocks(rng, kind, rows=5, blocks_per_row=3)
    _assert_bit_equal(dequantize(data, kind), gguf_dequantize(data, kind))
    _assert_bit_equal(dequantize(data[0], kind), gguf_dequantize(data[0], kind))  # one row


def test_q4_1_by_hand():
    # one block: d = 2, m = -1; byte i holds value i (low nibble) and value 16 + i (high nibble)
    block = np.zeros(20, np.uint8)
    block[0:2] = np.array([2.0], np.float16).view(np.uint8)
    block[2:4] = np.array([-1.0], np.float16).view(np.uint8)
    block[4:] = [(i % 16) | ((15 - i) << 4) for i in range(16)]  # lows 0..15, highs 15..0
    want = [2.0 * q - 1.0 for q in list(range(16)) + list(range(15, -1, -1))]
    np.testing.assert_array_equal(dequantize(block, GGMLQuantizationType.Q4_1), np.array(want, np.float32))


def test_other_types_go_to_gguf():
    values = np.arange(6, dtype=np.float16).reshape(2, 3)
    _assert_bit_equal(dequantize(values, GGMLQuantizationType.F16), values.astype(np.float32))


def test_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 20 bytes"):
        dequantize(np.zeros((2, 30), np.uint8), GGMLQuantizationType.Q4_1)


def test_every_tensor_of_smollm2_matches_gguf(smollm2_path):
    kinds = set()
    for tensor in GGUFFile(smollm2_path).tensors:
        kinds.add(tensor.tensor_type)
        _assert_bit_equal(dequantize(tensor.data, tensor.tensor_type), gguf_dequantize(tensor.data, tensor.tensor_type))
    assert {gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0} <= kinds  # the fast paths ran
