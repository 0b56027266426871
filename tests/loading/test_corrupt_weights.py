"""A truncated or corrupt weight file fails to load with an error that names it.

Each format's reader fails deep inside on a short file (gguf: numpy reshape and index
errors; safetensors: a SafetensorError; orbax: TensorStore's page-long spec or a bare
JSON error), none naming the file. The loaders raise WeightFileError (a ValueError)
instead: the file or directory, what is wrong, and the reader's message, shortened. The
server's CLI prints it and exits with status 2 before opening its port. The files are
tiny copies of the random-weight Llama, cut at points that hit each part of the format.
"""

import json
import os
import shutil
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import safetensors.numpy

import configs
from paged_jax.loading import load_model, save_checkpoint
from paged_jax.loading.errors import MAX_DETAIL_CHARS, WeightFileError
from paged_jax.loading.gguf_weights import load_gguf
from paged_jax.loading.hf_weights import _targets, load_hf_directory, read_raw_tensor
from paged_jax.model.llama import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = configs.get_config("tiny_llama")
HF_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=CFG.vocab_size,
                 hidden_size=CFG.hidden_size, intermediate_size=CFG.intermediate_size, num_hidden_layers=CFG.num_layers,
                 num_attention_heads=CFG.num_heads, num_key_value_heads=CFG.num_kv_heads,
                 max_position_embeddings=CFG.max_position_embeddings, tie_word_embeddings=True, hidden_act="silu",
                 rms_norm_eps=1e-6, rope_theta=CFG.rope_theta)
GGUF_LAYER_NAMES = {"attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight", "wq": "attn_q.weight",
                    "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
                    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}


def cut(src: str, dst: str, size: int) -> str:
    """A copy of `src`'s first `size` bytes (negative: all but the last -size)."""
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[:size])
    return dst


def assert_names(err: pytest.ExceptionInfo, path, *words: str) -> None:
    message = str(err.value)
    assert isinstance(err.value, ValueError) and err.value.path == str(path), message
    assert message.startswith(f"cannot load {path}: "), message
    for word in words:
        assert word in message, message
    assert "\n" not in message and len(message) < len(str(path)) + MAX_DETAIL_CHARS + 200, message


# ---- GGUF ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    params = jax.tree.map(np.asarray, init_params(CFG, jax.random.key(0)))
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in dict(block_count=CFG.num_layers, context_length=CFG.max_position_embeddings,
                           embedding_length=CFG.hidden_size, feed_forward_length=CFG.intermediate_size,
                           head_count=CFG.num_heads, head_count_kv=CFG.num_kv_heads, key_length=CFG.head_dim,
                           rope_freq_base=CFG.rope_theta, layer_norm_rms_eps=1e-5, bos_token_id=1,
                           eos_token_id=2).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", params["embed"])
    writer.add_tensor("output_norm.weight", params["final_norm"])
    for name, stacked in params["layers"].items():
        for layer, w in enumerate(stacked):
            writer.add_tensor(f"blk.{layer}.{GGUF_LAYER_NAMES[name]}", np.ascontiguousarray(w.T if w.ndim == 2 else w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    load_gguf(path)  # the uncut file loads
    return path


# cut in the last tensor's data, in the middle of the tensors, in the tensor infos, in the
# metadata, right after the magic bytes
@pytest.mark.parametrize("size", [-100, "half", 1000, 200, 30, 4])
def test_a_truncated_gguf_names_the_file(gguf_file, tmp_path, size):
    size = os.path.getsize(gguf_file) // 2 if size == "half" else size
    path = cut(gguf_file, str(tmp_path / "cut.gguf"), size)
    with pytest.raises(WeightFileError) as err:
        load_model(path)
    assert_names(err, path, "GGUF file", "truncated or corrupt", f"({os.path.getsize(path)} bytes)")


# ---- Hugging Face directories ----------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("hf"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(HF_CONFIG, f)
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(t.shape).astype(np.float32) for name, t in _targets(CFG).items()}
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
    load_hf_directory(path)  # the uncut directory loads
    return path


def _copy_with(hf_dir: str, tmp_path, content_of) -> str:
    """A copy of the HF directory whose model.safetensors is content_of(its bytes)."""
    target = str(tmp_path / "hf")
    shutil.copytree(hf_dir, target)
    weights = os.path.join(target, "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(content_of(data))
    return weights


def _header_len(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


DAMAGES = {
    "truncated-data": lambda d: d[:-1000],
    "truncated-at-half": lambda d: d[:len(d) // 2],
    "truncated-header": lambda d: d[:8 + _header_len(d) // 2],
    "empty": lambda d: b"",
    "header-garbage": lambda d: d[:8] + b"x" * _header_len(d) + d[8 + _header_len(d):],
    "header-length-garbage": lambda d: (10**12).to_bytes(8, "little") + d[8:],
}


@pytest.mark.parametrize("content_of", [pytest.param(f, id=name) for name, f in DAMAGES.items()])
def test_a_corrupt_safetensors_file_names_the_file(hf_dir, tmp_path, content_of):
    weights = _copy_with(hf_dir, tmp_path, content_of)
    with pytest.raises(WeightFileError) as err:
        load_model(os.path.dirname(weights))
    assert_names(err, weights, "safetensors file", "truncated or corrupt", f"({os.path.getsize(weights)} bytes)",
                 "SafetensorError")


def test_a_truncated_shard_is_the_one_named(hf_dir, tmp_path):
    """A sharded directory: the shard that was cut is named, not the directory."""
    tensors = safetensors.numpy.load_file(os.path.join(hf_dir, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    target = tmp_path / "sharded"
    target.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), target)
    for shard, shard_names in shards.items():
        safetensors.numpy.save_file({n: tensors[n] for n in shard_names}, str(target / shard))
    index = {"weight_map": {n: shard for shard, shard_names in shards.items() for n in shard_names}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    load_hf_directory(str(target))  # whole, it loads
    second = str(target / "model-00002-of-00002.safetensors")
    cut(second, second, os.path.getsize(second) - 10)
    with pytest.raises(WeightFileError) as err:
        load_hf_directory(str(target))
    assert_names(err, second, "truncated or corrupt")
    (target / "model.safetensors.index.json").write_text(json.dumps(index)[:40])
    with pytest.raises(WeightFileError) as err:
        load_hf_directory(str(target))
    assert_names(err, target / "model.safetensors.index.json", "not a JSON object")


def test_the_raw_reader_refuses_a_short_tensor(hf_dir, tmp_path):
    """read_raw_tensor (the bf16 fallback) checks the bytes it got, not just numpy's reshape."""
    weights = _copy_with(hf_dir, tmp_path, lambda d: d[:-1000])
    with open(os.path.join(hf_dir, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(_header_len(f.read(8))))
    header.pop("__metadata__", None)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])  # the tensor the cut reaches
    with pytest.raises(WeightFileError) as err:
        read_raw_tensor(weights, last)
    assert_names(err, weights, f"tensor {last} needs bytes", "it is truncated")


# ---- orbax checkpoints ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    save_checkpoint(path, CFG, init_params(CFG, jax.random.key(0)))
    return path


def _copy_checkpoint(checkpoint_dir: str, tmp_path) -> str:
    target = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint_dir, target)
    return target


def test_a_truncated_checkpoint_names_its_params_directory(checkpoint_dir, tmp_path):
    """Half of the largest data file is gone: TensorStore's byte-range error, with the
    parameter it was reading, in one line after the params/ directory."""
    target = _copy_checkpoint(checkpoint_dir, tmp_path)
    data_files = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(target, "params")) for f in files
                  if os.sep + "d" + os.sep in os.path.join(d, f)]
    largest = max(data_files, key=os.path.getsize)
    cut(largest, largest, os.path.getsize(largest) // 2)
    with pytest.raises(WeightFileError) as err:
        load_model(target)
    assert_names(err, os.path.join(target, "params"), "orbax could not restore", "truncated, missing or corrupt",
                 "OUT_OF_RANGE")
    assert "tensorstore_spec" not in str(err.value) and "TensorStore(" not in str(err.value)


def test_a_damaged_checkpoint_marker_or_missing_params_are_named(checkpoint_dir, tmp_path):
    target = _copy_checkpoint(checkpoint_dir, tmp_path)
    marker = os.path.join(target, "paged_jax_model.json")
    with open(marker) as f:
        meta = json.load(f)
    cut(marker, marker, os.path.getsize(marker) // 2)
    with pytest.raises(WeightFileError) as err:
        load_model(target)
    assert_names(err, marker, "not valid JSON", "truncated or corrupt")
    with open(marker, "w") as f:
        json.dump({k: v for k, v in meta.items() if k != "config"}, f)
    with pytest.raises(WeightFileError) as err:
        load_model(target)
    assert_names(err, marker, "does not describe a model", "KeyError")
    with open(marker, "w") as f:
        json.dump(meta, f)
    shutil.rmtree(os.path.join(target, "params"))
    with pytest.raises(WeightFileError) as err:
        load_model(target)
    assert_names(err, target, "no params/ directory")


# ---- the server's CLI ------------------------------------------------------------------------------
def test_the_cli_prints_the_error_and_exits_2(gguf_file, tmp_path):
    path = cut(gguf_file, str(tmp_path / "cut.gguf"), os.path.getsize(gguf_file) // 2)
    script = ("import sys; from paged_jax.entrypoints import cli; "
              "sys.exit(cli.main(['paged-jax', 'serve', *sys.argv[1:]]))")
    proc = subprocess.run([sys.executable, "-c", script, f"--model={path}", "--port=1", "--log_level=warning"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot start the server: cannot load {path}: the GGUF file" in proc.stderr, proc.stderr
    assert "truncated or corrupt" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
