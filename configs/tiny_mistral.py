"""A tiny random-weight Mistral: untied, sliding window of 32 tokens."""

from paged_jax.config.model_config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="mistral",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        sliding_window=32,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
