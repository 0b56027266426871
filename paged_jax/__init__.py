"""paged_jax: PagedAttention and vLLM-style serving in JAX/Flax + Pallas.

The public names load lazily, so `import paged_jax.core.block_manager` (pure Python) does
not pull in JAX and transformers.
"""

import importlib

_EXPORTS = {
    "LLM": "paged_jax.entrypoints.llm",
    "LLMEngine": "paged_jax.engine.llm_engine",
    "EngineConfig": "paged_jax.config.engine_config",
    "SamplingParams": "paged_jax.core.sampling_params",
    "RequestOutputKind": "paged_jax.core.sampling_params",
    "StructuredOutputsParams": "paged_jax.core.structured_outputs",
    "Logprob": "paged_jax.core.outputs",
    "BeamSearchParams": "paged_jax.core.beam_search",
    "BeamSearchOutput": "paged_jax.core.outputs",
    "RequestOutput": "paged_jax.core.outputs",
    "CompletionOutput": "paged_jax.core.outputs",
    "ModelConfig": "paged_jax.config.model_config",
    "RopeScaling": "paged_jax.config.model_config",
    "load_model": "paged_jax.loading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
