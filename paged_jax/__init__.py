"""paged_jax: PagedAttention and vLLM-style serving in JAX/Flax + Pallas."""

from paged_jax.model_config import ModelConfig, RopeScaling

__all__ = ["ModelConfig", "RopeScaling"]
