"""Hugging Face `config.json` (as a dict) -> `ModelConfig`, for Llama, Mistral, Qwen2, Qwen3.

Reads both generations of the format: transformers 4.x writes `rope_theta` next to a
`rope_scaling` dict (whose type is `rope_type`, or `type` in older files); 5.x writes one
`rope_parameters` dict holding `rope_theta`, `rope_type` and the scaling fields. A field
absent from the file takes the value the matching transformers config class defaults
to, so a file means here what it means to `transformers`.

Anything the decoder cannot reproduce exactly (MLP biases, RoPE types other than
default/linear/llama3, partial rotary, sliding windows on only some layers, quantized
weights, activations other than SiLU) is refused with a ValueError rather than
approximated: a model that loads must compute what `transformers` computes.
"""

from __future__ import annotations

from typing import Any

from paged_jax.config.model_config import SUPPORTED_ROPE_TYPES, ModelConfig, RopeScaling

# model_type -> the causal-LM class transformers builds for it (config.json's `architectures`).
CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Defaults of the transformers config classes for the fields a config.json may omit
# (transformers drops some fields equal to their defaults when it saves). The five shape
# fields (vocab, hidden, intermediate, layers, heads) have no default here: the class
# defaults describe 7B models, and a file without them is not a usable model description.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, sliding_window=None),
    "mistral": dict(max_position_embeddings=4096 * 32, bos_token_id=1, eos_token_id=2, sliding_window=4096,
                    num_key_value_heads=8),
    "qwen2": dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, sliding_window=4096),
    "qwen3": dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, sliding_window=4096,
                  head_dim=128),
}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2/Qwen3: layers from this index on use the sliding window
_SCALED_ROPE_TYPES = [t for t in SUPPORTED_ROPE_TYPES if t != "default"]


def config_from_hf(hf: dict) -> ModelConfig:
    """Convert a `config.json` dict of a Llama/Mistral/Qwen2/Qwen3 causal LM to a ModelConfig.

    Raises ValueError naming the offending field and what is supported when the file
    describes something this decoder does not implement exactly.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"expected the config.json contents as a dict, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in CAUSAL_LM_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(CAUSAL_LM_CLASSES)}")
    defaults = _DEFAULTS[model_type]
    _check_architectures(hf, model_type)
    _check_unsupported(hf, model_type)

    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if hf.get(k) is None]
    if missing:
        raise ValueError(f"config.json of model_type {model_type!r} lacks required fields {missing}")
    num_layers = hf["num_hidden_layers"]
    num_heads = hf["num_attention_heads"]
    num_kv_heads = hf.get("num_key_value_heads", defaults.get("num_key_value_heads"))
    if num_kv_heads is None:  # transformers: no key/value head count means plain multi-head attention
        num_kv_heads = num_heads
    head_dim = hf.get("head_dim", defaults.get("head_dim"))  # None: hidden_size // num_heads
    max_position_embeddings = hf.get("max_position_embeddings", defaults["max_position_embeddings"])
    rope_theta, rope_scaling = _rope(hf, max_position_embeddings)

    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias = {"llama": attention_bias, "mistral": False, "qwen2": True, "qwen3": attention_bias}[model_type]
    o_bias = {"llama": attention_bias, "mistral": False, "qwen2": False, "qwen3": attention_bias}[model_type]

    eos = hf.get("eos_token_id", defaults["eos_token_id"])
    eos_token_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))

    return ModelConfig(
        architecture=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(hf, model_type, num_layers),
        bos_token_id=hf.get("bos_token_id", defaults["bos_token_id"]),
        eos_token_ids=eos_token_ids,
    )


def _check_architectures(hf: dict, model_type: str) -> None:
    """A causal-LM head is needed; e.g. LlamaForSequenceClassification has no lm_head."""
    architectures = hf.get("architectures")
    if architectures and CAUSAL_LM_CLASSES[model_type] not in architectures:
        raise ValueError(
            f"unsupported architectures {architectures} for model_type {model_type!r}; "
            f"supported: {CAUSAL_LM_CLASSES[model_type]} (a causal language model)")


def _check_unsupported(hf: dict, model_type: str) -> None:
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True (biases on the gate/up/down projections) is unsupported; "
                         "supported: mlp_bias=False")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}; supported: 'silu' (SwiGLU MLP)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ValueError(f"quantized checkpoints (quant_method {method!r}) are unsupported; "
                         "supported: unquantized float32/float16/bfloat16 weights")


def _rope(hf: dict, max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`.

    Like transformers 5, a non-empty `rope_scaling` wins over `rope_parameters`, and
    `rope_theta` inside the chosen dict wins over a top-level one.
    """
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict or null, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters (a nested rope_parameters dict) are unsupported; "
                         "supported: one RoPE setting shared by all layers")
    theta = float(params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is unsupported; supported: 1.0 (RoPE on the "
                         "whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in _SCALED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    required = ["factor"] + (["low_freq_factor", "high_freq_factor"] if rope_type == "llama3" else [])
    absent = [k for k in required if params.get(k) is None]
    if absent:
        raise ValueError(f"{rope_type} RoPE scaling needs {required}; missing {absent}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    return theta, RopeScaling(
        "llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        # transformers 5 falls back to max_position_embeddings when the field is absent.
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        max_position_embeddings)))


def _sliding_window(hf: dict, model_type: str, num_layers: int) -> int | None:
    """The window if every layer slides, None if none does; ValueError for a mix.

    Llama has no sliding window (transformers ignores the field). Mistral slides on
    every layer when `sliding_window` is set. Qwen2/Qwen3 slide only when
    `use_sliding_window` is true, and then only on the layers `layer_types` marks
    "sliding_attention" (5.x), or, without `layer_types`, on layers
    >= `max_window_layers` (4.x).
    """
    if model_type == "llama":
        return None
    window = hf.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    if model_type == "mistral" or window is None:
        return window
    if not hf.get("use_sliding_window", False):
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        allowed = ("full_attention", "sliding_attention")
        if len(layer_types) != num_layers or any(t not in allowed for t in layer_types):
            raise ValueError(f"layer_types must list one of {allowed} per layer ({num_layers} layers), "
                             f"got {layer_types}")
        sliding = [t == "sliding_attention" for t in layer_types]
    else:
        max_window_layers = hf.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        sliding = [i >= max_window_layers for i in range(num_layers)]
    if all(sliding):
        return window
    if not any(sliding):
        return None
    raise ValueError(
        f"{model_type} sliding window ({window}) on only layers {[i for i, s in enumerate(sliding) if s]} "
        f"of {num_layers} (max_window_layers / layer_types) is unsupported; supported: a sliding window "
        "on every layer or on none")
