"""Opt-in persistent XLA compilation cache, so warm-up compiles are paid once per machine.

Called explicitly by entry points and tests; importing paged_jax changes no JAX setting.
"""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "jax")


def enable_compilation_cache(path: str | None = None, *, min_compile_seconds: float = 0.5) -> str:
    """Store compiled programs under `path` (default ~/.cache/paged_jax/jax or
    $PAGED_JAX_CACHE_DIR) and reuse them across processes. Returns the directory."""
    path = path or os.environ.get("PAGED_JAX_CACHE_DIR") or DEFAULT_DIR
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return path
