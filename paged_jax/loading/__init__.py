"""Weight and tokenizer loading: GGUF files, Hugging Face directories, orbax checkpoints."""

from paged_jax.loading.checkpoint import load_checkpoint, save_checkpoint
from paged_jax.loading.loader import LoadedModel, load_model
from paged_jax.loading.registry import DEFAULT_MODEL, REGISTRY

__all__ = ["DEFAULT_MODEL", "REGISTRY", "LoadedModel", "load_checkpoint", "load_model", "save_checkpoint"]
