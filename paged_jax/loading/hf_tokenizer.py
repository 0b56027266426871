"""A Hugging Face tokenizer directory loaded with an error that names the broken file.

A truncated or corrupt tokenizer.json otherwise fails inside the `tokenizers` Rust core
("EOF while parsing a string at line 1 column 81920") or in transformers' fallback to a
slow tokenizer, neither naming the file. Loading raises WeightFileError instead, as the
weight readers do (errors.py): the file that does not parse (or the directory, when each
of its JSON files parses and the tokenizer still cannot be built), what is wrong, and the
library's own message, shortened.
"""

from __future__ import annotations

import json
import os

from paged_jax.loading.errors import WeightFileError, detail, file_size
from paged_jax.loading.transformers_import import import_transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one: a tokenizer is there
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_hf_tokenizer(path: str):
    """transformers.AutoTokenizer.from_pretrained(path); WeightFileError when it fails."""
    auto_tokenizer = import_transformers().AutoTokenizer
    try:
        return auto_tokenizer.from_pretrained(path)
    except Exception as err:  # tokenizers' Exception, JSONDecodeError, OSError, ValueError, ...
        broken = _unparsable_json(path)
        if broken is not None:
            file, json_err = broken
            raise WeightFileError(file, f"the tokenizer file is not valid JSON ({file_size(file)}): is it truncated "
                                        f"or corrupt? ({detail(json_err)})") from err
        raise WeightFileError(path, f"transformers could not build the tokenizer from this directory "
                                    f"({detail(err)})") from err


def _unparsable_json(path: str) -> tuple[str, Exception] | None:
    """(the first of the directory's tokenizer JSON files that does not parse, its error)."""
    for name in _JSON_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, UnicodeDecodeError) as err:
            return file, err
    return None
