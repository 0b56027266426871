"""A tiny random-weight Llama with SmolLM2's real tokenizer, saved as a Hugging Face directory.

For tests that need a real tokenizer but not a real model (lm-eval against the server,
structured outputs: a constraint must hold whatever the model's preferences), at the
cost of a 2-layer, 64-wide model. The weights are transformers', so the same directory
serves as the transformers reference.
"""

from __future__ import annotations

import torch
import transformers

from paged_jax.loading.gguf_tokenizer import load_gguf_tokenizer
from paged_jax.loading.registry import resolve
from tests.helpers.hf_variants import SHAPE, reinit


def save_tiny_smollm2_vocab(path: str, seed: int = 21):
    """Write the model and tokenizer to `path`; returns (the transformers model, the tokenizer)."""
    tokenizer = load_gguf_tokenizer(resolve("smollm2-135m"))
    config = transformers.LlamaConfig(**{**SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 256},
                                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    reinit(hf, seed=seed)
    hf.eval()
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return hf, tokenizer
