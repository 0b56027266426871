"""GGUF loading: config, tokenizer and weights against `transformers` reading the same file.

transformers is the oracle: it dequantizes with the same `gguf` package and un-permutes
llama.cpp's q/k rows itself, so our params must equal its weights, and greedy decoding
with them must give its tokens. The expensive loads are module-scoped fixtures.
"""

import dataclasses
import math
import os

import gguf
import jax
import numpy as np
import pytest
import torch

import configs
from paged_jax.baselines.reference import generate
from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
from paged_jax.loading.gguf_weights import load_gguf
from paged_jax.model.llama import init_params
from tests.helpers.greedy_check import assert_greedy_match

NEW_TOKENS = 32
MULTILINGUAL = (
    "Hello world! The year 2024 had 366 days.\n"
    "Français : où est la bibliothèque ? Ça coûte 3,50 € — déjà vu, naïve.\n"
    "Deutsch: Größe, Straße, Übermäßig schön.\n"
    "中文：你好，世界！机器学习很有趣。\n"
    "日本語：こんにちは、世界。カタカナとひらがな。\n"
    "Русский: Привет, мир! Ёлка.\n"
    "العربية: مرحبا بالعالم\n"
    "Emoji: 🤗🚀 👩‍👩‍👧 ✨\n"
    "def f(x):\n\tif x:\n\t\treturn x ** 2  # comment\n\n\n    spaces   end  \n"
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|><jupyter_code>print(1)<file_sep>x<repo_name>"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}],
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village in the mountains,",
    "Hi",
]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return load_gguf(smollm2_path)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf


def _chat_prompt(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """PROMPTS plus two chat-templated ones (the last asks for the capital of France)."""
    texts = PROMPTS + [_chat_prompt(tokenizer, "Give me two tips for learning a language."),
                       _chat_prompt(tokenizer, "What is the capital of France?")]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def our_outputs(ours, prompt_ids):
    """All prompts in one batch: one compilation, and batching with ragged lengths exercised."""
    cfg, params = ours
    return generate(params, cfg, prompt_ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _hf_greedy(model, ids):
    """HF greedy decoding of one unpadded prompt for exactly NEW_TOKENS tokens.

    `eos_token_id=[]` disables the EOS stop (None would fall back to the model's EOS).
    """
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0)
    return out[0, len(ids):].tolist()


def _hf_next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def test_config_matches_preset(ours):
    assert ours[0] == configs.get_config("smollm2_135m")


def test_tokenizer_encodes_and_decodes_like_transformers(tokenizer, hf_tokenizer):
    for text in [MULTILINGUAL, " leading space", "trailing\n\n", "a" * 50, "12345678 3.14159", ""]:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    special = tokenizer.encode("<|im_start|>user<|im_end|>")
    assert special[0] == 1 and special[-1] == 2  # control tokens are matched whole, no BOS added
    # Control tokens other than bos/eos/unk/pad are special too (dropped by skip_special_tokens).
    assert tokenizer.decode(tokenizer.encode("a<jupyter_code>b<file_sep>"), skip_special_tokens=True) == "ab"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
            assert ours == theirs
            assert tokenizer.encode(ours) == hf_tokenizer.encode(theirs)


def test_weights_match_transformers(ours, hf_model):
    """Equal to transformers' weights; q/k only once llama.cpp's row permutation is undone."""
    params = ours[1]
    layer = hf_model.model.layers[7]
    pairs = [
        (params["embed"], hf_model.model.embed_tokens.weight),
        (params["layers"]["wq"][7], layer.self_attn.q_proj.weight.T),
        (params["layers"]["wk"][7], layer.self_attn.k_proj.weight.T),
        (params["layers"]["wv"][7], layer.self_attn.v_proj.weight.T),
        (params["layers"]["w_down"][7], layer.mlp.down_proj.weight.T),
        (params["layers"]["attn_norm"][7], layer.input_layernorm.weight),
        (params["final_norm"], hf_model.model.norm.weight),
    ]
    for ours_w, theirs_w in pairs:
        np.testing.assert_allclose(np.asarray(ours_w), theirs_w.detach().numpy(), rtol=0, atol=1e-6)


def test_greedy_matches_transformers(hf_model, prompt_ids, our_outputs):
    for ids, got in zip(prompt_ids, our_outputs):
        assert len(got) == NEW_TOKENS
        assert_greedy_match(ids, _hf_greedy(hf_model, ids), got, lambda p: _hf_next_logits(hf_model, p))


def test_chat_answers_paris(tokenizer, our_outputs):
    answer = tokenizer.decode(our_outputs[-1], skip_special_tokens=True)
    assert "Paris" in answer, answer


def _write_gguf(path, arch, tensors, **metadata):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _llamacpp_permute(w, num_heads):
    """llama.cpp's convert_hf_to_gguf `permute` of q/k rows (the transform we must undo)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llamacpp_rope_freqs(cfg):
    """llama.cpp's convert_hf_to_gguf `rope_freqs` for llama3 scaling: one divisor per frequency."""
    s = cfg.rope_scaling
    divisors = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / cfg.head_dim)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        divisors.append(1.0 if wavelen < s.original_max_position_embeddings / s.high_freq_factor else
                        s.factor if wavelen > s.original_max_position_embeddings / s.low_freq_factor else
                        1 / ((1 - smooth) / s.factor + smooth))
    return np.array(divisors, np.float32)


@pytest.mark.parametrize("preset,permuted", [("tiny_llama_untied", True), ("tiny_qwen2", False), ("tiny_qwen3", False)])
def test_round_trip_through_a_written_gguf(tmp_path, preset, permuted):
    """Our params written the way llama.cpp's converter writes them load back exactly.

    Covers what SmolLM2 lacks: an untied lm_head, q/k/v biases (permuted for llama),
    q/k norms, and the unpermuted Qwen layouts.
    """
    cfg = configs.get_config(preset)
    if permuted:
        cfg = dataclasses.replace(cfg, qkv_bias=True, o_bias=True)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0)))
    hf_names = {"attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight", "wq": "attn_q.weight",
                "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias",
                "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias", "q_norm": "attn_q_norm.weight",
                "k_norm": "attn_k_norm.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
                "w_down": "ffn_down.weight"}
    tensors = {"token_embd.weight": params["embed"], "output_norm.weight": params["final_norm"]}
    if "lm_head" in params:
        tensors["output.weight"] = params["lm_head"].T
    for name, stacked in params["layers"].items():
        for layer, w in enumerate(stacked):
            w = w.T if w.ndim == 2 and not name.endswith("norm") else w  # to HF's [out, in]
            if permuted and name in ("wq", "bq", "wk", "bk"):
                w = _llamacpp_permute(w, cfg.num_heads if name[1] == "q" else cfg.num_kv_heads)
            tensors[f"blk.{layer}.{hf_names[name]}"] = w
    rope = {}
    if cfg.rope_scaling is not None:  # llama.cpp writes llama3 scaling as a per-frequency divisor tensor
        tensors["rope_freqs.weight"] = _llamacpp_rope_freqs(cfg)
        rope["rope_scaling_orig_ctx_len"] = cfg.rope_scaling.original_max_position_embeddings
    path = _write_gguf(
        tmp_path / "tiny.gguf", cfg.architecture, tensors, **rope, block_count=cfg.num_layers,
        context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size,
        feed_forward_length=cfg.intermediate_size, head_count=cfg.num_heads, head_count_kv=cfg.num_kv_heads,
        key_length=cfg.head_dim, rope_freq_base=cfg.rope_theta, layer_norm_rms_eps=cfg.rms_norm_eps,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids[0])
    loaded_cfg, loaded = load_gguf(path)
    assert loaded_cfg == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, params)


def test_unmatched_rope_freqs_raise(tmp_path):
    """A rope_freqs tensor that llama3 scaling cannot reproduce is refused, not approximated."""
    cfg = configs.get_config("tiny_llama_untied")
    path = _write_gguf(tmp_path / "rope.gguf", "llama",
                       {"token_embd.weight": np.zeros((cfg.vocab_size, cfg.hidden_size)),
                        "rope_freqs.weight": _llamacpp_rope_freqs(cfg) * np.linspace(1.0, 1.5, cfg.head_dim // 2)},
                       block_count=1, context_length=512, embedding_length=cfg.hidden_size, feed_forward_length=8,
                       head_count=cfg.num_heads, key_length=cfg.head_dim, layer_norm_rms_eps=1e-5,
                       rope_freq_base=cfg.rope_theta, rope_scaling_orig_ctx_len=64)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf(path)


def test_unsupported_architecture_and_tokenizer_raise(tmp_path):
    path = _write_gguf(tmp_path / "falcon.gguf", "falcon", {"token_embd.weight": np.zeros((4, 8))},
                       block_count=1, tokenizer_model="llama", token_list=["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"'falcon'.*supported: \['llama', 'mistral', 'qwen2', 'qwen3'\]"):
        load_gguf(path)
    with pytest.raises(ValueError, match=r"'llama'.*supported: \['gpt2'\]"):
        load_gguf_tokenizer(path)
