"""Attention over the KV cache: the paged path (cache writes + attention kernels handed in
as arguments: the Pallas kernels, their jnp reference, the XLA chunked loop, or the
platform's own), and the dense contiguous-cache path of the reference generate. Which
backend "auto" picks is the platform layer's (paged_jax/platform/)."""
