"""Opt-in persistent XLA compilation cache, so warm-up compiles are paid once per machine.

Called explicitly by entry points (the server, `LLM(...)` unless told not to) and tests;
importing paged_jax changes no JAX setting.

Every program is stored, however quickly it compiled (JAX's default stores only those that
took over 1 s). Why: a warm start compiles whatever the cache lacks, and on a CPU most of
an engine's programs compile in well under a second (the sampling heads, small buckets,
the eager ops of weight packing) but together cost seconds. SmolLM2-135M with default
settings compiles 56 programs: with a 0.5 s threshold 24 were stored and a warm start
still spent 4.2 s in the compiler; with none, all 56 were read back and it spent 2.0 s
(reads included), on 2 shared cores (one-off runs of `python -m experiments.startup_time`,
whose record reports a start's compile events).

The same switch turns on the executable cache (executable_cache.py, in the sibling directory
`<path>-executables`), which keeps the compiled programs whole so that a warm start need not
trace and lower them to find them here.
"""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "jax")


def enable_compilation_cache(path: str | None = None, *, min_compile_seconds: float = 0.0) -> str:
    """Store compiled programs under `path` (default ~/.cache/paged_jax/jax or
    $PAGED_JAX_CACHE_DIR) and reuse them across processes. `min_compile_seconds`: store
    only programs that took longer to compile (0: every program). Returns the directory."""
    if min_compile_seconds < 0:
        raise ValueError(f"min_compile_seconds must be >= 0, got {min_compile_seconds!r}")
    path = path or os.environ.get("PAGED_JAX_CACHE_DIR") or DEFAULT_DIR
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return path
