"""Attention over the KV cache: the paged path (cache writes + the Pallas kernel or its jnp
reference, pallas_kernels/), the dense contiguous-cache path of the reference generate, and
which backend "auto" picks per platform."""
