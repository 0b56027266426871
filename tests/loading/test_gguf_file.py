"""paged_jax.loading.gguf_file against the `gguf` package's own reader, on files its writer
wrote: every metadata type, plain and quantized tensors, both byte orders, and SmolLM2's
real file. Then damaged headers: each is a ValueError saying what is wrong."""

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from paged_jax.loading.gguf_file import GGUFFile


def _write(path, endianess=gguf.GGUFEndian.LITTLE) -> str:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "Ġthe", "<|im_start|>"])
    writer.add_tensor("plain.f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((64,)).astype(np.float16))
    if endianess == gguf.GGUFEndian.LITTLE:  # the writer byte-swaps plain arrays only
        q = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor("quant.q8_0", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _assert_same_as_gguf(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        np.testing.assert_array_equal(a.data, b.data)
    return ours


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_every_value_type_and_tensor_reads_as_ggufs_reader_reads_it(tmp_path, endianess):
    ours = _assert_same_as_gguf(_write(tmp_path / "all.gguf", endianess))
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.u64"] == 2**63 + 5
    assert ours.fields["t.strs"] == ["a", "", "Ġthe", "<|im_start|>"]
    # values, not just agreement: a plain tensor reads back as written, in numpy order
    plain = next(t for t in ours.tensors if t.name == "plain.f32")
    assert plain.shape == (64, 3) and plain.data.shape == (3, 64)


def test_smollm2s_file_reads_as_ggufs_reader_reads_it(smollm2_path):
    ours = _assert_same_as_gguf(smollm2_path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def _damaged(tmp_path, name: str, edit) -> str:
    data = bytearray(open(_write(tmp_path / "ok.gguf"), "rb").read())
    path = tmp_path / name
    path.write_bytes(bytes(edit(data)))
    return str(path)


def _set(data: bytearray, offset: int, value: bytes) -> bytearray:
    data[offset:offset + len(value)] = value
    return data


KEY0 = 4 + 4 + 8 + 8  # the first metadata key's length field
DAMAGES = {
    "empty": (lambda d: b"", "24 bytes"),
    "not gguf": (lambda d: b"GGML" + d[4:], "no GGUF magic"),
    "version 7": (lambda d: _set(d, 4, (7).to_bytes(4, "little")), "version 7"),
    "cut in the metadata": (lambda d: d[:KEY0 + 20], "past the end"),
    "huge key length": (lambda d: _set(d, KEY0, (10**15).to_bytes(8, "little")), "runs past the end"),
    "huge metadata count": (lambda d: _set(d, 16, (10**12).to_bytes(8, "little")), "past the end|the file ends"),
    "cut in the data": (lambda d: d[:-300], "needs bytes up to"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_header_is_a_value_error_that_says_what(tmp_path, name):
    edit, words = DAMAGES[name]
    with pytest.raises(ValueError, match=words):
        GGUFFile(_damaged(tmp_path, name.replace(" ", "_"), edit))


def test_the_vocabulary_parses_in_well_under_a_second(smollm2_path):
    """The point of this reader: gguf's took seconds for SmolLM2's vocabulary and merges."""
    import time
    start = time.perf_counter()
    GGUFFile(smollm2_path)
    assert time.perf_counter() - start < 1.5, "parsing SmolLM2's header should take a fraction of a second"
