"""What the server's console shows at start-up: no library notice that reads as an error
(paged_jax/entrypoints/startup_messages.py), and one last line saying where it serves."""

import logging
import pathlib
import subprocess
import sys

import pytest

from paged_jax.entrypoints.startup_messages import JAX_BACKEND_LOGGER, MissingPluginFilter, quiet_missing_backends

ROOT = pathlib.Path(__file__).resolve().parents[2]
MISSING = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: cannot open "
           "shared object file: No such file or directory")


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord(JAX_BACKEND_LOGGER, logging.INFO, __file__, 1, message, None, None)


def test_only_missing_plugin_libraries_are_dropped():
    quiet = MissingPluginFilter()
    assert not quiet.filter(_record(MISSING))
    assert quiet.filter(_record("Unable to initialize backend 'tpu': TPU is already in use by process 123"))
    assert quiet.filter(_record("Unable to initialize backend 'cuda': CUDA driver version is insufficient"))
    assert quiet.filter(_record("Platform 'cpu' is experimental"))


def test_installed_once():
    logger = logging.getLogger(JAX_BACKEND_LOGGER)
    first = quiet_missing_backends()
    try:
        assert quiet_missing_backends() is first
        assert sum(isinstance(f, MissingPluginFilter) for f in logger.filters) == 1
    finally:
        logger.removeFilter(first)


@pytest.mark.parametrize("quiet", [False, True])
def test_jax_start_on_this_machine(quiet):
    """With INFO logging (as under absl), JAX's look for a TPU prints the missing libtpu.so
    here; the entry point's filter removes exactly that line. (Without the filter the line
    must appear, or this test would prove nothing.)"""
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
            + ("from paged_jax.entrypoints.startup_messages import quiet_missing_backends\n"
               "quiet_missing_backends()\n" if quiet else "")
            + "import jax\nprint(jax.devices())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": ""})
    assert result.returncode == 0, result.stderr
    assert ("Unable to initialize backend 'tpu'" in result.stderr) is (not quiet), result.stderr
