"""The model an experiment runs: real weights by name, or a configs preset with random weights.

Benchmarks take `--model=smollm2-135m` (any `load_model` source) for figures, and
`--model=tiny_llama` (any `configs.PRESETS` name starting with tiny_) for a fast dry
run of the script itself: random weights, never for claims. `--model=random:<preset>`
gives any preset random weights (e.g. `random:smollm2_135m`: the real shapes, for a
machine that cannot carry the real weights). Every script that builds random weights
goes through `random_model`, so that they all get the same weights (init key 0) and
the same `random:<preset>` source in their records.
"""

from __future__ import annotations

import dataclasses

RANDOM_PREFIX = "random:"


def random_model(preset: str, max_model_len: int = 0, dtype: str | None = None, source: str | None = None):
    """A LoadedModel of configs preset `preset` with random weights (init key 0), its
    position limit raised to `max_model_len` where that is longer, params in `dtype`
    (None: init_params' float32); `source` defaults to `random:<preset>`."""
    import jax

    import configs
    from paged_jax.loading import LoadedModel
    from paged_jax.model.llama import init_params
    cfg = configs.get_config(preset)  # raises on an unknown preset, naming the known ones
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_model_len))
    params = init_params(cfg, jax.random.key(0), jax.numpy.dtype(dtype or "float32"))
    return LoadedModel(cfg, params, None, source or f"{RANDOM_PREFIX}{preset}", "memory", 0.0)


def load_for_benchmark(name: str, max_model_len: int):
    """A LoadedModel: `random:<preset>` or a tiny_* preset name with random weights whose
    position limit is raised to `max_model_len`; anything else `load_model(name)` in float32."""
    import configs
    from paged_jax.loading import load_model
    if name.startswith(RANDOM_PREFIX):
        return random_model(name[len(RANDOM_PREFIX):], max_model_len)
    if name in configs.PRESETS and name.startswith("tiny_"):
        return random_model(name, max_model_len)
    return load_model(name, dtype="float32")
