"""The persistent compilation cache stores every program, quick compiles included.

Each case runs in a fresh process: JAX opens its persistent cache once per process, and
this test process's cache is tests/conftest.py's."""

import os
import subprocess
import sys

import pytest

from paged_jax.worker.compilation_cache import enable_compilation_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COMPILE_ONE = r"""
import sys
import jax, jax.numpy as jnp
from paged_jax.worker.compilation_cache import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
def add_one(x):
    return x + 1
jax.block_until_ready(jax.jit(add_one)(jnp.arange(3.0)))  # compiles in milliseconds
"""


def _cache_entries(tmp_path) -> list[str]:
    run = subprocess.run([sys.executable, "-c", _COMPILE_ONE, str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, check=False)
    assert run.returncode == 0, run.stderr
    return [name for name in os.listdir(tmp_path) if "add_one" in name]


def test_a_program_that_compiles_quickly_is_stored(tmp_path):
    # JAX's default (1 s) and the former 0.5 s threshold stored nothing here
    assert _cache_entries(tmp_path)


def test_negative_threshold_is_refused(tmp_path):
    with pytest.raises(ValueError, match="min_compile_seconds must be >= 0"):
        enable_compilation_cache(str(tmp_path), min_compile_seconds=-1.0)
