"""experiments/bench_models.py: the one place experiments build random-weight models.

random:<preset> gives any configs preset (not only tiny_*) random weights, the same
weights a tiny_* name gets, with the position limit lifted to the run's max_model_len;
an unknown preset is refused with the known ones named."""

import jax
import numpy as np
import pytest

import configs
from experiments.bench_models import load_for_benchmark, random_model
from paged_jax.model.llama import init_params


def test_random_prefix_builds_any_preset_with_init_key_0():
    loaded = load_for_benchmark("random:tiny_mistral", 2048)
    base = configs.get_config("tiny_mistral")
    assert loaded.source == "random:tiny_mistral"
    assert loaded.config.max_position_embeddings == 2048 > base.max_position_embeddings
    expected = init_params(loaded.config, jax.random.key(0))
    for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tiny_name_and_random_prefix_are_the_same_model():
    a, b = load_for_benchmark("tiny_llama", 64), load_for_benchmark("random:tiny_llama", 64)
    assert a.source == b.source == "random:tiny_llama"
    assert a.config == b.config  # a shorter max_model_len never lowers the preset's limit
    assert a.config.max_position_embeddings == configs.get_config("tiny_llama").max_position_embeddings
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_random_model_dtype_and_source():
    loaded = random_model("tiny_llama", dtype="bfloat16", source="tiny_llama")
    assert loaded.source == "tiny_llama"
    assert {leaf.dtype for leaf in jax.tree.leaves(loaded.params)} == {jax.numpy.dtype("bfloat16")}


def test_unknown_preset_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown config preset 'nope'.*tiny_llama"):
        load_for_benchmark("random:nope", 128)
