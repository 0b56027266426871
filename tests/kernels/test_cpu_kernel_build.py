"""cpu_kernels/build.py compiles each source on its own, several at once, then links.

A real build through a logging wrapper around the real compiler: it writes each
invocation's arguments and its start and end times, so the test sees how the build
called the compiler, and the library it produced must load with every FFI symbol."""

import ctypes
import itertools
import os
import shutil
import stat

import pytest

from cpu_kernels import build

_WRAPPER = """#!/bin/sh
log="{log}.$$"
echo "start $(date +%s.%N)" > "$log"
echo "$@" >> "$log"
"{compiler}" "$@"
rc=$?
echo "end $(date +%s.%N)" >> "$log"
exit $rc
"""


def _invocations(log_dir):
    """(start, end, args) of each compiler call."""
    out = []
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            start, args, end = f.read().splitlines()
        out.append((float(start.split()[1]), float(end.split()[1]), args.split()))
    return out


@pytest.mark.slow  # a full g++ build of every kernel (~10 s on 2 idle cores); the default run builds once, cached
def test_sources_compile_separately_and_in_parallel(tmp_path, monkeypatch):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    wrapper = tmp_path / "cxx"
    wrapper.write_text(_WRAPPER.format(log=log_dir / "call", compiler=compiler))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("PAGED_JAX_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    build.library_path.cache_clear()
    try:
        path = build.library_path()
    finally:
        build.library_path.cache_clear()

    library = ctypes.CDLL(path)
    assert all(hasattr(library, symbol) for symbol in build.TARGETS.values())
    calls = _invocations(log_dir)
    compiles = [c for c in calls if "-c" in c[2]]
    compiled = [os.path.basename(arg) for _, _, args in compiles for arg in args if arg.endswith(".cc")]
    assert sorted(compiled) == sorted(build.SOURCES)  # one call per source
    assert all(sum(a.endswith(".cc") for a in args) == 1 for _, _, args in compiles)
    [link] = [c for c in calls if "-c" not in c[2]]
    assert "-shared" in link[2] and link[0] >= max(end for _, end, _ in compiles)
    if build._num_cores() >= 2:  # some compiles ran at the same time
        spans = sorted((start, end) for start, end, _ in compiles)
        assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))
    assert not [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".so")]  # objects cleaned up
