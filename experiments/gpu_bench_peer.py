"""The Hugging Face transformers model experiments/gpu_bench.py serves as its peer: a configs
preset's shapes as a transformers config, randomly initialized by transformers, on the GPU
where there is one.

Why random weights of the same shapes, not the paged_jax run's own: the comparison is of
throughput on one trace with ignore_eos (every request generates exactly its max_tokens),
which the weights' values do not change; greedy equality with the reference is checked
apart, in float32 (gpu_bench.sh's f32 stage). Only the Llama and Qwen3 architectures the
benchmark's presets use are mapped.
"""

from __future__ import annotations


def hf_config(cfg):
    """A transformers config of ModelConfig `cfg`'s shapes (llama or qwen3)."""
    import transformers
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                  rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                  tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
                  eos_token_id=list(cfg.eos_token_ids) or None)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        common["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                  "high_freq_factor": s.high_freq_factor,
                                  "original_max_position_embeddings": s.original_max_position_embeddings}
    if cfg.architecture == "qwen3":
        return transformers.Qwen3Config(**common)
    if cfg.architecture == "llama" and not cfg.qk_norm:
        return transformers.LlamaConfig(**common)
    raise ValueError(f"no transformers peer for architecture {cfg.architecture!r} (llama and qwen3 only)")


def hf_model(preset: str, dtype: str, seed: int):
    """(model, torch device name): preset `preset`'s shapes in `dtype`, transformers' own random
    initialization (seeded), in eval mode on "cuda" where torch sees a GPU, else "cpu"."""
    import torch
    import transformers

    import configs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(configs.get_config(preset)),
                                                              dtype=getattr(torch, dtype))
    return model.eval(), device
