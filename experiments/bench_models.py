"""The model an experiment runs: real weights by name, or a tiny random-weight preset.

Benchmarks take `--model=smollm2-135m` (any `load_model` source) for figures, and
`--model=tiny_llama` (any `configs.PRESETS` name starting with tiny_) for a fast dry
run of the script itself: random weights, never for claims.
"""

from __future__ import annotations

import dataclasses


def load_for_benchmark(name: str, max_model_len: int):
    """A LoadedModel: `load_model(name)` in float32, or a tiny preset with random weights
    whose position limit is raised to `max_model_len`."""
    import jax

    import configs
    from paged_jax.loading import LoadedModel, load_model
    from paged_jax.model.llama import init_params
    if not (name in configs.PRESETS and name.startswith("tiny_")):
        return load_model(name, dtype="float32")
    cfg = configs.get_config(name)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_model_len))
    return LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, f"random:{name}", "memory", 0.0)
