"""Native CPU kernels, built from C++ source on first use (an XLA FFI custom call each)."""
