"""A truncated or corrupt tokenizer file fails to load with an error that names it.

A Hugging Face directory's tokenizer.json cut short, or a checkpoint's saved tokenizer
cut short, otherwise fails inside the `tokenizers` Rust core with "EOF while parsing",
naming no file. load_model raises WeightFileError naming the file instead
(paged_jax/loading/hf_tokenizer.py), as it does for weight files.
"""

import os
import shutil

import jax
import pytest

from paged_jax.loading import load_model, save_checkpoint
from paged_jax.loading.errors import WeightFileError
from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
from paged_jax.loading.hf_tokenizer import load_hf_tokenizer
from paged_jax.loading.registry import resolve
from paged_jax.model.llama import init_params
from tests.loading.test_corrupt_weights import CFG, assert_names, cut


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer (from its GGUF), as save_pretrained writes it."""
    path = str(tmp_path_factory.mktemp("tokenizer"))
    load_gguf_tokenizer(resolve("smollm2-135m")).save_pretrained(path)
    assert load_hf_tokenizer(path).encode("Hello world")  # the uncut files load
    return path


@pytest.mark.parametrize("name,size", [("tokenizer.json", 0.5), ("tokenizer.json", 1), ("tokenizer_config.json", 0.5)])
def test_a_truncated_tokenizer_file_is_named(tokenizer_dir, tmp_path, name, size):
    """Cut to half its bytes, or to its first byte."""
    target = str(tmp_path / "tok")
    shutil.copytree(tokenizer_dir, target)
    file = os.path.join(target, name)
    cut(file, file, int(os.path.getsize(file) * size) if size < 1 else 1)
    with pytest.raises(WeightFileError) as err:
        load_hf_tokenizer(target)
    assert_names(err, file, "not valid JSON", "truncated or corrupt", "JSONDecodeError")


def test_a_checkpoints_truncated_tokenizer_is_named(tokenizer_dir, tmp_path):
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, CFG, init_params(CFG, jax.random.key(0)), tokenizer=load_hf_tokenizer(tokenizer_dir))
    file = os.path.join(path, "tokenizer", "tokenizer.json")
    cut(file, file, os.path.getsize(file) // 3)
    with pytest.raises(WeightFileError) as err:
        load_model(path)
    assert_names(err, file, "not valid JSON")


def test_a_tokenizer_that_parses_but_cannot_be_built_names_the_directory(tokenizer_dir, tmp_path):
    """Valid JSON that is not a tokenizer: the directory is named, with transformers' reason."""
    target = str(tmp_path / "tok")
    shutil.copytree(tokenizer_dir, target)
    with open(os.path.join(target, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(WeightFileError) as err:
        load_hf_tokenizer(target)
    assert_names(err, target, "could not build the tokenizer")
