"""The one error a weight file (or a tokenizer file) that cannot be read raises, whichever format it is in.

A truncated download, a disk that filled up mid-copy or a file that is not what its name
says otherwise surfaces from deep inside a reader (gguf's numpy views, safetensors' Rust
core, orbax/tensorstore) as a reshape error, an IndexError or a page of TensorStore spec,
none of which names the file. Every loader catches those where it reads and raises
WeightFileError instead: the file (or checkpoint directory) and what is wrong with it,
with the reader's own message, shortened, at the end. It is a ValueError, as every other
loading error here is, so callers (the server's CLI among them) handle one type.
"""

from __future__ import annotations

import os

MAX_DETAIL_CHARS = 300  # of the underlying reader's message (TensorStore's run to pages)


class WeightFileError(ValueError):
    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"cannot load {path}: {problem}")


def detail(err: BaseException) -> str:
    """`Type: first line of the message`, at most MAX_DETAIL_CHARS characters, of the
    innermost exception `err` was raised from (orbax wraps TensorStore's error, which
    names the parameter and the byte range that is missing, in a generic one)."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    text = lines[0].split(" [tensorstore_spec=")[0] if lines else ""
    if len(text) > MAX_DETAIL_CHARS:
        text = text[:MAX_DETAIL_CHARS] + " ..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def file_size(path: str) -> str:
    """'N bytes' (or why the size is unknown), for messages about truncated files."""
    try:
        return f"{os.path.getsize(path)} bytes"
    except OSError as err:
        return f"size unknown: {err.strerror}"
