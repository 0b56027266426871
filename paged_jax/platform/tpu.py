"""The TPU platform.

Attention: the jnp reference. The Pallas Mosaic kernels lower through jax.export and pass
their tests in TPU interpret mode, but have not yet run on a TPU, so "auto" does not take
them ("pallas" can be asked for explicitly). Matmuls: XLA's dot on [in, out] weights.
Engine defaults: the accelerator's, as on GPU (base.ACCELERATOR_DEFAULTS).
"""

from __future__ import annotations

from paged_jax.platform.base import ACCELERATOR_DEFAULTS, Platform


class TpuPlatform(Platform):
    name = "tpu"
    attention_preference = ("reference",)
    defaults = ACCELERATOR_DEFAULTS
