"""Rotary position embeddings (RoPE), in Hugging Face's "rotate half" layout.

Checkpoints store q/k projection rows so that dimension i pairs with i + head_dim/2
(the GGUF loader undoes llama.cpp's interleaved permutation to get this layout).
Frequencies are computed on the host in float32 exactly as `transformers` does, so
logits match it to float rounding.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from paged_jax.config.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[head_dim // 2]: the rotation speed of each dimension pair."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths slowed by `factor`, short ones kept, a linear ramp between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions i32[*tok] -> (cos, sin), each f32[*tok, head_dim], computed in the graph."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rope_tables(inv_freq: np.ndarray, num_positions: int) -> np.ndarray:
    """f32[2, num_positions, head_dim]: cos and sin of every position below num_positions,
    with the same float32 angles as `rope_cos_sin`.

    Why a table: XLA fuses the cheap-looking cos/sin into every consumer (an optimization
    barrier does not survive the CPU pipeline), so each layer's q and k rotation recomputed
    them per head with scalar libm calls: sincos was 9% of a 1024-token SmolLM2 prefill step
    on CPU (a one-off `perf` profile, not a committed record). A row gather per layer costs
    almost nothing."""
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.stack([np.cos(angles), np.sin(angles)]).astype(np.float32)


def lookup_cos_sin(tables: jnp.ndarray, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(cos, sin) rows of `rope_tables` for positions i32[*tok] (clamped to the table)."""
    rows = jnp.take(tables, positions, axis=1, mode="clip")
    return rows[0], rows[1]


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [*tok, heads, head_dim]; cos/sin f32[*tok, head_dim]. Returns x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)
