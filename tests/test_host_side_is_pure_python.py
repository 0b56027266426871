"""The host-side bookkeeping imports neither JAX nor numpy (DESIGN.md: pure Python)."""

import subprocess
import sys

PURE = ["paged_jax.block_pool", "paged_jax.block_manager", "paged_jax.scheduler", "paged_jax.scheduler_output",
        "paged_jax.sequence", "paged_jax.sampling_params", "paged_jax.engine_config", "paged_jax.outputs",
        "paged_jax.beam_search", "paged_jax.contiguous_allocator"]


def test_host_modules_do_not_import_jax_or_numpy():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in PURE) +
            "bad = sorted(m for m in ('jax', 'numpy') if m in sys.modules)\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
