"""ModelConfig validation and the presets."""

import pytest

import configs
from paged_jax.config.model_config import ModelConfig, RopeScaling


def _tiny(**overrides):
    base = dict(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                num_layers=1, num_heads=4, num_kv_heads=2)
    base.update(overrides)
    return ModelConfig(**base)


def test_head_dim_derived_from_hidden_size():
    assert _tiny().head_dim == 4  # 16 / 4 heads


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(hidden_size=18, num_heads=4, num_kv_heads=2), "not divisible by num_heads"),
    (dict(architecture="gpt2"), "supported: \\['llama', 'mistral', 'qwen2', 'qwen3'\\]"),
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(head_dim=5), "positive even int"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(eos_token_ids=(32,)), "outside the vocabulary"),
])
def test_bad_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        _tiny(**overrides)


def test_explicit_head_dim_need_not_divide_hidden_size():
    assert _tiny(hidden_size=18, num_heads=4, num_kv_heads=2, head_dim=8).q_size == 32


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'yarn'"):
        RopeScaling("yarn", factor=4.0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling("llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)


def test_configs_are_hashable_static_arguments():
    assert hash(_tiny()) == hash(_tiny())
    assert _tiny() != _tiny(rope_theta=1.0)


@pytest.mark.parametrize("name", configs.PRESETS)
def test_presets_load(name):
    assert isinstance(configs.get_config(name), ModelConfig)


def test_unknown_preset():
    with pytest.raises(ValueError, match="available"):
        configs.get_config("gpt-5")


def test_smollm2_parameter_count():
    # SmolLM2-135M: 49152*576 tied embeddings + 30 layers of (attention 576*(576+2*192)+576*576,
    # MLP 3*576*1536, two norms 2*576) + final norm 576 = 134,515,008.
    assert configs.get_config("smollm2_135m").num_params() == 134_515_008
