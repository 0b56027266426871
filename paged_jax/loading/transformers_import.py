"""`transformers`, imported without its "PyTorch was not found" notice.

paged_jax's runtime needs no torch (torch is a test dependency), and `import
transformers` without torch logs, on every start: "PyTorch was not found. Models won't
be available and only tokenizers, configuration and file/data utilities can be used."
Tokenizers and configurations are all paged_jax uses transformers for, so the notice is
true and harmless, but it reads as an error. paged_jax imports transformers only through
`import_transformers()` (tests/loading/test_transformers_import.py checks that), which
drops exactly that one record while the import runs and leaves transformers' logging as
it found it afterwards: its other warnings, and any later record, come through. The
environment switch TRANSFORMERS_NO_ADVISORY_WARNINGS would also hide it, but with every
other advisory warning, for the whole process.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from types import ModuleType

TORCH_NOTICE = "PyTorch was not found."  # how transformers' notice begins (transformers/__init__.py)
_LOGGER = "transformers"  # the logger that logs it: transformers' library root logger


class _DropTorchNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TORCH_NOTICE)


@contextlib.contextmanager
def torch_notice_silenced():
    """While the block runs, transformers' "PyTorch was not found" record is dropped; any
    other record passes. The filter sits on the logger that logs the notice (filters on a
    logger see only its own records, not its children's), and is removed on exit."""
    logger = logging.getLogger(_LOGGER)
    drop = _DropTorchNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def import_transformers() -> ModuleType:
    """The `transformers` module; the first import logs no torch notice (later ones are
    `sys.modules` look-ups, which log nothing)."""
    with torch_notice_silenced():
        return importlib.import_module("transformers")
