"""Compile the C++ kernels once per machine and register them with XLA.

Why built here and not shipped as a wheel: the kernels are a few hundred lines that a
researcher should be able to edit and rerun, and they are compiled for this CPU
(`-march=native`: AVX-512 where the machine has it; $PAGED_JAX_CPU_MARCH overrides it,
e.g. x86-64-v3 builds the AVX2-only path an AVX-512 machine would not otherwise run,
which tests/attention/test_native_attention.py checks). The shared library lands in
~/.cache/paged_jax/cpu_kernels (or $PAGED_JAX_KERNEL_CACHE_DIR), named by a hash of the
source, the compiler command and the CPU's feature flags, so an edit, another compiler or
another machine gets its own build; the first call compiles, later ones load. Each source
compiles to its own object file, as many at once as the process has cores, and then they
link: one g++ call over every source compiled them one after another (15 s on 2 idle
cores, 58 s on 2 shared ones, 23 s of it ragged_paged_attention.cc alone), all of it
silent time in a new user's first start-up.
`available()` says whether the kernels can run here (a C++ compiler and jaxlib's FFI
headers); the engine's "auto" attention backend uses it to choose.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

SOURCES = ("ragged_paged_attention.cc", "write_kv.cc", "amx_matmul.cc", "f32_matmul.cc", "helper_threads.cc")
HEADERS = ("attention_vectors.h", "amx_tiles.h", "attention_amx.h", "attention_problem.h", "matmul_epilogues.h", "helper_threads.h")
TARGETS = {  # FFI target name -> symbol in the library
    "paged_jax_ragged_paged_attention_f32": "RaggedPagedAttentionF32",
    "paged_jax_ragged_paged_attention_bf16": "RaggedPagedAttentionBF16",
    "paged_jax_write_kv_f32": "WriteKvF32",
    "paged_jax_write_kv_bf16": "WriteKvBF16",
    "paged_jax_amx_matmul_bf16": "AmxMatmulBF16",
    "paged_jax_amx_swiglu_bf16": "AmxSwigluBF16",
    "paged_jax_amx_logits_argmax_bf16": "AmxLogitsArgmaxBF16",
    "paged_jax_f32_matmul": "F32Matmul",
    "paged_jax_f32_swiglu": "F32Swiglu",
    "paged_jax_f32_logits_argmax": "F32LogitsArgmax",
}
FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-fPIC")  # compiling a source to an object
LINK_FLAGS = ("-shared",)


class NativeKernelError(RuntimeError):
    """The native kernels cannot be built or loaded on this machine (the message says why)."""


def cache_dir() -> str:
    return os.environ.get("PAGED_JAX_KERNEL_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "cpu_kernels"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _compile_command(compiler: str, include_dir: str, source: str, output: str) -> list[str]:
    march = os.environ.get("PAGED_JAX_CPU_MARCH", "native")
    return [compiler, *FLAGS, f"-march={march}", f"-I{include_dir}", "-c", source, "-o", output]


def _link_command(compiler: str, objects: list[str], output: str) -> list[str]:
    return [compiler, *LINK_FLAGS, *objects, "-o", output]


def _num_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise NativeKernelError(f"building the CPU kernels failed ({' '.join(command)}):\n{result.stderr[-4000:]}")


def _build(compiler: str, include_dir: str, sources: list[str], output: str) -> None:
    """Compile every source to an object in a temporary folder beside `output`, up to one
    compiler per core at once (the longest sources come first in SOURCES), then link."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(output)) as work:
        objects = [os.path.join(work, f"{i}_{os.path.basename(src)}.o") for i, src in enumerate(sources)]
        commands = [_compile_command(compiler, include_dir, src, obj) for src, obj in zip(sources, objects)]
        with ThreadPoolExecutor(max_workers=min(len(commands), _num_cores())) as pool:
            for done in [pool.submit(_run, command) for command in commands]:
                done.result()  # the first failure, with its compiler's message
        _run(_link_command(compiler, objects, output))


@functools.cache
def library_path() -> str:
    """The built shared library (compiling it first if this machine has none yet)."""
    import jax.ffi
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise NativeKernelError(f"no C++ compiler {compiler!r} on PATH (set $CXX, or use another attention backend)")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = [os.path.join(here, name) for name in SOURCES]
    digest = hashlib.sha256()
    for path in sources + [os.path.join(here, name) for name in HEADERS]:
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(_compile_command(compiler, "", "", "") + _link_command(compiler, [], "")).encode())
    digest.update(_cpu_flags().encode() + platform.machine().encode())
    out_dir = cache_dir()
    target = os.path.join(out_dir, f"paged_jax_cpu_kernels_{digest.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=out_dir)  # then an atomic rename: concurrent builds are safe
    os.close(fd)
    try:
        _build(compiler, jax.ffi.include_dir(), sources, partial)
    except BaseException:
        os.unlink(partial)
        raise
    os.replace(partial, target)
    return target


@functools.cache
def register() -> None:
    """Build (if needed), load and register every FFI target for the CPU platform."""
    import jax.ffi
    library = ctypes.cdll.LoadLibrary(library_path())
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


@functools.cache
def available() -> bool:
    """True if the kernels are built and registered (or can be, now). False, with a
    warning that says why (once), where they cannot be: the caller then takes another
    implementation."""
    try:
        register()
    except (NativeKernelError, OSError) as e:
        warnings.warn(f"the native CPU kernels are unavailable, falling back: {e}", RuntimeWarning, stacklevel=2)
        return False
    return True
