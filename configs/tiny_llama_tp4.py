"""A tiny random-weight Llama whose heads divide a 4-device mesh (8 query / 4 KV heads),
untied, for tensor-parallel tests at tensor_parallel_size 1, 2 and 4."""

from paged_jax.config.model_config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
