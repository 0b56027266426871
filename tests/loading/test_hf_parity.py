"""Hugging Face directories load into the same model `transformers` runs.

Each variant is a tiny random-weight model built with transformers + torch (fp32, eager
attention), re-initialised at a scale where every part of it moves the output, saved
with `save_pretrained`, loaded with `load_hf_directory`, and compared with
`transformers`: logits at every prompt position to 1e-4, greedy tokens exactly (up to a
checked near-tie). Then the file-format cases (shards, bf16), then the errors.
"""

import copy
import dataclasses
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from safetensors import safe_open

from paged_jax.baselines import reference
from paged_jax.loading.hf_config import config_from_hf
from paged_jax.loading.hf_weights import load_hf_directory, read_raw_tensor
from tests.helpers.greedy_check import assert_greedy_match
from tests.helpers.hf_variants import SHAPE, VARIANTS, reinit

LOGIT_TOL = 1e-4
PROMPT_LENS = (1, 5, 17, 40)
NEW_TOKENS = 16
def _prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in lens]


def _hf_logits(model, token_ids) -> np.ndarray:
    """f32[len, vocab]: transformers' logits at every position of one unpadded prompt."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(hf_model, directory, cfg, params) for one variant, built and loaded once per module."""
    hf_config = VARIANTS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager",
                                                          dtype=torch.float32)
    reinit(model, seed=len(request.param))
    model.eval()
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    cfg, params = load_hf_directory(path)
    return model, path, cfg, params


def test_config_reflects_variant(variant):
    """The switches the parity tests rely on actually came through config.json."""
    model, _, cfg, _ = variant
    hf = model.config
    assert cfg.architecture == hf.model_type
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.qk_norm == (hf.model_type == "qwen3")
    assert cfg.sliding_window == (8 if hf.model_type == "mistral" else None)
    assert cfg.qkv_bias == (hf.model_type == "qwen2" or getattr(hf, "attention_bias", False))
    assert cfg.o_bias == (hf.model_type != "qwen2" and getattr(hf, "attention_bias", False))
    rope = hf.rope_parameters
    assert cfg.rope_theta == rope["rope_theta"]
    assert (cfg.rope_scaling.rope_type if cfg.rope_scaling else "default") == rope["rope_type"]
    eos = hf.eos_token_id
    assert cfg.eos_token_ids == (tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,))


def test_prompt_logits_match_transformers(variant):
    model, _, cfg, params = variant
    prompts = _prompts(seed=1)
    ours = reference.prompt_logits(params, cfg, prompts)
    for prompt, got in zip(prompts, ours):
        want = _hf_logits(model, prompt)
        assert np.std(want) > 0.5, "degenerate test model: logits barely vary"
        np.testing.assert_allclose(got, want, atol=LOGIT_TOL, rtol=0,
                                   err_msg=f"prompt of length {len(prompt)}")


def test_greedy_generate_matches_transformers(variant):
    """All 16 decode steps compared: EOS is off on both sides (random models emit it early)."""
    model, _, cfg, params = variant
    prompts = _prompts(seed=2)
    ours = reference.generate(params, cfg, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    all_tokens = []
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == len(prompt) + NEW_TOKENS
        want = out[0, len(prompt):].tolist()
        assert_greedy_match(prompt, want, got, lambda ids: _hf_logits(model, ids)[-1])
        all_tokens += want
    assert len(set(all_tokens)) > 8, f"degenerate test model: greedy output {all_tokens}"


@pytest.mark.parametrize("variant", ["mistral_window8"], indirect=True)
def test_sliding_window_matters(variant):
    """A 30-token prompt with window 8: matching transformers requires the window.

    Without it our logits agree for the first 8 positions (nothing falls out of the
    window yet) and then depart far beyond the tolerance; so transformers does apply
    the window, and the parity above would catch a loader that dropped it.
    """
    model, _, cfg, params = variant
    assert cfg.sliding_window == 8
    prompt = _prompts(seed=3, lens=(30,))[0]
    want = _hf_logits(model, prompt)
    windowed = reference.prompt_logits(params, cfg, [prompt])[0]
    full = reference.prompt_logits(params, dataclasses.replace(cfg, sliding_window=None), [prompt])[0]
    np.testing.assert_allclose(windowed, want, atol=LOGIT_TOL, rtol=0)
    np.testing.assert_allclose(full[:8], want[:8], atol=LOGIT_TOL, rtol=0)
    assert np.abs(full[8:] - want[8:]).max() > 100 * LOGIT_TOL


@pytest.mark.parametrize("variant", ["llama_untied_llama3_bias"], indirect=True)
def test_sharded_checkpoint_loads_identically(variant, tmp_path):
    model, path, cfg, params = variant
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 2
    sharded_cfg, sharded = load_hf_directory(str(tmp_path))
    assert sharded_cfg == cfg
    _assert_same_params(sharded, params)


@pytest.mark.parametrize("variant", ["qwen3_bias"], indirect=True)
def test_bf16_checkpoint_loads(variant, tmp_path):
    """bf16 on disk: read exactly (as torch rounds), returned in the dtype asked for."""
    model, _, cfg, params = variant
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)
    rounded = _map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), params)
    as_f32_cfg, as_f32 = load_hf_directory(str(tmp_path))
    assert as_f32_cfg == cfg
    _assert_same_params(as_f32, _map(lambda a: a.astype(np.float32), rounded))
    _, as_bf16 = load_hf_directory(str(tmp_path), dtype=jnp.bfloat16)
    assert all(a.dtype == jnp.bfloat16 for a in _leaves(as_bf16))
    _assert_same_params(as_bf16, rounded)
    # The raw-bytes path (used where safetensors' numpy backend lacks bf16) reads the same.
    file_path = str(tmp_path / "model.safetensors")
    with safe_open(file_path, framework="numpy") as f:
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight"):
            raw = read_raw_tensor(file_path, name)
            assert raw.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(raw.astype(np.float32), f.get_tensor(name).astype(np.float32))


@pytest.mark.parametrize("variant", ["llama_tied"], indirect=True)
def test_tensor_mismatch_is_listed(variant, tmp_path):
    """A config promising biases, or fewer layers, than the files hold: every name listed."""
    _, path, _, _ = variant
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    os.symlink(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    _write_config(tmp_path, {**hf, "attention_bias": True})
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.k_proj.bias'.*unexpected \[\]"):
        load_hf_directory(str(tmp_path))
    _write_config(tmp_path, {**hf, "num_hidden_layers": 1})
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['model.layers.1.input_layernorm.weight'"):
        load_hf_directory(str(tmp_path))


@pytest.mark.parametrize("variant", ["llama_tied"], indirect=True)
def test_tied_embedding_rules(variant, tmp_path):
    """No lm_head in the files: the embedding is the head (and the config says so). A tied
    config whose files also hold lm_head: fine if it is the embedding, an error if not."""
    _, path, cfg, params = variant
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    os.symlink(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    _write_config(tmp_path, {**hf, "tie_word_embeddings": False})
    untied_cfg, untied = load_hf_directory(str(tmp_path))
    assert untied_cfg == cfg and cfg.tie_word_embeddings and "lm_head" not in untied

    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    with_head = tmp_path / "with_head"
    with_head.mkdir()
    _write_config(with_head, hf)
    safetensors.numpy.save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]},
                                str(with_head / "model.safetensors"))
    _assert_same_params(load_hf_directory(str(with_head))[1], params)
    safetensors.numpy.save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] * 2},
                                str(with_head / "model.safetensors"))
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        load_hf_directory(str(with_head))


def test_unknown_model_type_rejected(tmp_path):
    _write_config(tmp_path, {"model_type": "gpt2", "vocab_size": 256})
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'; supported: \['llama', 'mistral', "):
        load_hf_directory(str(tmp_path))


def test_mlp_bias_rejected(tmp_path):
    transformers.LlamaConfig(**SHAPE, mlp_bias=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="mlp_bias=True .* unsupported"):
        load_hf_directory(str(tmp_path))


def test_heads_not_multiple_of_kv_heads_rejected():
    hf = {**SHAPE, "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        config_from_hf(hf)


def test_not_a_model_directory_rejected(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_hf_directory(str(tmp_path))  # empty directory
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_hf_directory(str(tmp_path / "weights.safetensors"))  # a file
    _write_config(tmp_path, {**SHAPE, "model_type": "llama"})
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_directory(str(tmp_path))  # config but no weights


# ---- config.json dialects, as plain dicts (no weights) ------------------------------------

_LLAMA = {**SHAPE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def test_transformers4_and_5_rope_fields_agree():
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    v5 = config_from_hf({**_LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}})
    v4 = config_from_hf({**_LLAMA, "rope_theta": 500000, "rope_scaling": {"rope_type": "llama3", **llama3}})
    v4_legacy = config_from_hf({**_LLAMA, "rope_theta": 500000, "rope_scaling": {"type": "llama3", **llama3}})
    assert v5 == v4 == v4_legacy
    assert v5.rope_theta == 500000.0 and v5.rope_scaling.rope_type == "llama3"
    assert v5.rope_scaling.original_max_position_embeddings == 64

    linear = config_from_hf({**_LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_theta == 10000.0 and linear.rope_scaling.factor == 2.0
    plain = config_from_hf({**_LLAMA, "rope_theta": 1e6, "rope_scaling": None})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_unsupported_rope_rejected():
    with pytest.raises(ValueError, match=r"unsupported RoPE type 'yarn'; supported: \['default', 'linear'"):
        config_from_hf({**_LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is unsupported"):
        config_from_hf({**_LLAMA, "partial_rotary_factor": 0.5})


def test_special_tokens_and_biases():
    assert config_from_hf({**_LLAMA, "eos_token_id": [2, 7]}).eos_token_ids == (2, 7)
    assert config_from_hf({**_LLAMA, "eos_token_id": 5}).eos_token_ids == (5,)
    qwen2 = config_from_hf({**SHAPE, "model_type": "qwen2", "attention_bias": False})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.eos_token_ids) == (True, False, False, ())
    qwen3 = config_from_hf({**SHAPE, "model_type": "qwen3"})
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (False, False, True, 128)
    with pytest.raises(ValueError, match=r"architectures \['LlamaForSequenceClassification'\].*LlamaForCausalLM"):
        config_from_hf({**_LLAMA, "architectures": ["LlamaForSequenceClassification"]})


@pytest.mark.parametrize("fields, window", [
    ({"use_sliding_window": False, "sliding_window": 4096}, None),  # 4.x files keep the number
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),  # all layers
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, None),  # layers >= 2: none
    ({"use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["sliding_attention", "sliding_attention"]}, 16),
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, ValueError),
    ({"use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["full_attention", "sliding_attention"]}, ValueError),
])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_window(model_type, fields, window):
    hf = {**SHAPE, "model_type": model_type, **fields}
    if window is ValueError:
        with pytest.raises(ValueError, match=r"only layers \[1\] of 2 .* unsupported"):
            config_from_hf(hf)
    else:
        assert config_from_hf(hf).sliding_window == window


# ---- helpers -------------------------------------------------------------------------------

def _write_config(directory, hf: dict) -> None:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)


def _leaves(params):
    return [params[k] for k in sorted(params) if k != "layers"] + [params["layers"][k] for k in sorted(params["layers"])]


def _map(fn, params):
    return {k: ({n: fn(a) for n, a in v.items()} if k == "layers" else fn(v)) for k, v in params.items()}


def _assert_same_params(got, want):
    assert sorted(got) == sorted(want) and sorted(got["layers"]) == sorted(want["layers"])
    for a, b in zip(_leaves(got), _leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
