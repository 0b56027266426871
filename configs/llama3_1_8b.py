"""Llama-3.1-8B's shapes (meta-llama/Llama-3.1-8B config.json): 32 layers, hidden 4096, 32 query /
8 KV heads of 128, SwiGLU 14336, a 128,256-token vocabulary, untied LM head, llama3 RoPE scaling.
Used with random weights (`random:llama3_1_8b`) where the real ones are not at hand (the GPU
benchmark)."""

from paged_jax.config.model_config import ModelConfig, RopeScaling


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001,),
    )
