"""Qwen3-0.6B's shapes (Qwen/Qwen3-0.6B config.json): 28 layers, hidden 1024, 16 query / 8 KV
heads of 128, SwiGLU 3072, a 151,936-token vocabulary, tied embeddings, q/k RMSNorm. Used with
random weights (`random:qwen3_0_6b`) where the real ones are not at hand (the GPU benchmark)."""

from paged_jax.config.model_config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        bos_token_id=None,
        eos_token_ids=(151645, 151643),
    )
