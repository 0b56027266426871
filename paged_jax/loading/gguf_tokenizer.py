"""Build a Hugging Face fast tokenizer from a GGUF file's metadata.

A GGUF has no tokenizer.json: it stores the vocabulary, the BPE merges, a token type per
token, the special token ids, the chat template, and in `tokenizer.ggml.pre` the name of
the pre-tokenizer (the regex that cuts text into words before BPE). We rebuild the
tokenizer with the `tokenizers` library so text encodes exactly as the model was
trained, without a model hub download.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`, used by SmolLM2, Llama 3, Qwen2/3,
Mistral's newer models) is supported; its tokens are already spelled in the byte-level
alphabet, so the vocabulary and merges go in unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from paged_jax.loading.transformers_import import import_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# Split regexes as in the models' tokenizer.json (and llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Pre-tokenizers whose merges were learned with `ignore_merges` (a whole word in the
# vocabulary is one token even when the merges would not build it).
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe")


def _gpt2_regex() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> pre-tokenizer. "default" and "gpt2" use GPT-2's regex (built into
# ByteLevel); "smollm" (like starcoder) first isolates every digit, then GPT-2's regex.
_PRE_TOKENIZERS = {
    "default": _gpt2_regex,
    "gpt2": _gpt2_regex,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_regex()]),
    "starcoder": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_regex()]),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


def _metadata(path: str, reader=None) -> dict:
    """tokenizer.* metadata (and nothing else) as Python values (of `reader`, the file already
    opened, when given)."""
    from paged_jax.loading.gguf_weights import open_gguf  # a truncated file: WeightFileError naming it
    reader = reader if reader is not None else open_gguf(path)
    return {key: value for key, value in reader.fields.items() if key.startswith("tokenizer.")}


def load_gguf_tokenizer(path: str, reader=None) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file describes, as a `transformers` fast tokenizer.

    Control tokens (token type 3, e.g. `<|im_start|>`) become special tokens, matched whole
    in the input and skipped by `decode(..., skip_special_tokens=True)`; user-defined
    tokens (type 4, e.g. `<think>`) are matched whole but stay ordinary. BOS is prepended
    only when the file's `tokenizer.ggml.add_bos_token` says so (default: no, except for
    Llama 3's pre-tokenizer, where llama.cpp adds it).
    """
    meta = _metadata(path, reader)  # `reader`: the file's GGUFFile, when the caller opened it already
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: {list(SUPPORTED_TOKENIZER_MODELS)}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ttype in zip(tokens, token_types) if ttype == gguf.TokenType.CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ttype in zip(tokens, token_types) if ttype == gguf.TokenType.USER_DEFINED])

    def token(name: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[token_id] if token_id is not None else None

    return import_transformers().PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"), eos_token=token("eos"), unk_token=token("unknown"), pad_token=token("padding"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", pre in _IGNORE_MERGES)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )
