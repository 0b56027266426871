"""The native kernels' helper threads (helper_threads.cc): how long they spin between calls.

Each native CPU kernel call (attention, the f32 and AMX matmuls) splits its work items
between the calling thread and helper threads. By default these are the library's own
helpers, which spin for a short window after each call (300 us) before they sleep: a
decode step makes about 200 short calls, and a sleeping thread in a virtual machine wakes
slowly. $PAGED_JAX_CPU_SPIN_US sets the window when the library loads; 0 gives the work
to XLA's intra-op pool instead (the kernels' behaviour before the helpers).
`python -m experiments.helper_threads` measures what the window is worth on a decode step.
"""

from __future__ import annotations

import ctypes
import functools

from cpu_kernels import build


@functools.cache
def _library():
    library = ctypes.cdll.LoadLibrary(build.library_path())
    library.paged_jax_cpu_set_spin_us.argtypes = [ctypes.c_int]
    library.paged_jax_cpu_set_spin_us.restype = ctypes.c_int
    library.paged_jax_cpu_spin_us.restype = ctypes.c_int
    return library


def set_spin_us(us: int) -> int:
    """Set the helpers' spin window in microseconds for the calls that follow (0: XLA's
    intra-op pool takes the helpers' part instead); returns the previous window."""
    if us < 0:
        raise ValueError(f"the spin window is a number of microseconds >= 0, got {us}")
    return _library().paged_jax_cpu_set_spin_us(int(us))


def spin_us() -> int:
    """The current spin window in microseconds."""
    return _library().paged_jax_cpu_spin_us()
