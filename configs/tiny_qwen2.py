"""A tiny random-weight Qwen2: q/k/v projections with bias, tied embeddings."""

from paged_jax.config.model_config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        qkv_bias=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
