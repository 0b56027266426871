"""Model configuration: one frozen dataclass for every supported Llama-family variant.

The variants differ only in a few switches (q/k/v bias, q/k RMSNorm, sliding window,
tied embeddings), so one config and one model function cover Llama, Mistral, Qwen2
and Qwen3. The config is hashable so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in Hugging Face's `rope_scaling` / `rope_parameters`.

    `linear` divides every frequency by `factor`; `llama3` (Llama 3.1) divides only the
    low frequencies, with a smooth ramp between `low_freq_factor` and `high_freq_factor`
    wavelengths measured against `original_max_position_embeddings`.
    """

    rope_type: str  # one of SUPPORTED_ROPE_TYPES other than "default"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES or self.rope_type == "default":
            raise ValueError(
                f"unsupported RoPE scaling type {self.rope_type!r}; supported: "
                f"{[t for t in SUPPORTED_ROPE_TYPES if t != 'default']} (or no scaling)"
            )
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and variant switches of a Llama-family decoder.

    Invariants checked here: positive sizes, `num_heads` a multiple of `num_kv_heads`
    (grouped-query attention), and `head_dim` given or derivable from
    `hidden_size / num_heads`.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads // num_kv_heads queries share each
    head_dim: int | None = None  # None: hidden_size // num_heads (must divide)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` keys
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # generation stops at any of these

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{list(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads "
                    f"({self.num_heads}); give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE pairs), got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be None or > 0, got {self.sliding_window}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for t in self.eos_token_ids + ((self.bos_token_id,) if self.bos_token_id is not None else ()):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"special token id {t} outside the vocabulary [0, {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = (
            2 * h  # norms
            + h * (self.q_size + 2 * self.kv_size) + self.q_size * h
            + 3 * h * i
            + (self.q_size + 2 * self.kv_size if self.qkv_bias else 0)
            + (h if self.o_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h
