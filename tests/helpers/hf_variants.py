"""Tiny random-weight transformers configs covering every switch the HF loader maps, and
a re-initialisation at a scale where every part of the model moves the output: shared by
the HF parity, beam search, engine-vs-transformers and HF-peer tests."""

import torch
import transformers

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

# name -> transformers config; together they cover every switch the loader maps.
VARIANTS = {
    "llama_tied": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "llama_untied_llama3_bias": lambda: transformers.LlamaConfig(
        **{**SHAPE, "num_key_value_heads": 1}, tie_word_embeddings=False, attention_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)),
    # window 8 < the 17- and 40-token prompts, so the window shapes the outputs compared.
    "mistral_window8": lambda: transformers.MistralConfig(**SHAPE, sliding_window=8, tie_word_embeddings=False),
    "qwen2_linear_rope": lambda: transformers.Qwen2Config(
        **SHAPE, tie_word_embeddings=True, eos_token_id=[2, 3],
        rope_parameters=dict(rope_type="linear", rope_theta=1000000.0, factor=2.0)),
    # head_dim 32 != hidden_size / num_heads = 16; attention_bias gives q/k/v/o biases.
    "qwen3_bias": lambda: transformers.Qwen3Config(**SHAPE, head_dim=32, attention_bias=True,
                                                   tie_word_embeddings=False),
}


def reinit(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that norms, biases and every layer visibly change the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:  # [out, in] projections and lm_head; 0.15 ~ 1.2 / sqrt(64)
                p.copy_(0.15 * noise)
