"""Model presets: one module per supported model, each with `get_config()`.

Presets hold numbers only, no logic. `get_config(name)` looks one up by module name.
"""

import importlib

PRESETS = ("smollm2_135m", "qwen3_0_6b", "llama3_1_8b", "tiny_llama", "tiny_llama_tp4", "tiny_llama_untied",
           "tiny_mistral", "tiny_qwen2", "tiny_qwen3")


def get_config(name: str):
    """The ModelConfig of preset `name` (one of PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown config preset {name!r}; available: {list(PRESETS)}")
    return importlib.import_module(f"configs.{name}").get_config()
