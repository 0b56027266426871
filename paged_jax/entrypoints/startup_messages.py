"""What the server's console shows at start-up, minus the noise that reads as an error.

JAX tries every platform plugin it knows when it first touches a device and, where one's
library is simply not installed (no libtpu.so on a GPU or CPU machine), logs "Unable to
initialize backend 'tpu': ... cannot open shared object file" at INFO; under absl's INFO
logging every start of the server printed it, and a newcomer reads it as a failure. The
filter drops exactly those records: a plugin that is installed but fails to start (a TPU
that is busy, a CUDA driver mismatch) still logs its reason.
"""

from __future__ import annotations

import logging

JAX_BACKEND_LOGGER = "jax._src.xla_bridge"
_MISSING_LIBRARY = ("cannot open shared object file", "No such file or directory")


class MissingPluginFilter(logging.Filter):
    """Drops JAX's "Unable to initialize backend" records whose cause is a missing library."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Unable to initialize backend")
                    and any(reason in message for reason in _MISSING_LIBRARY))


def quiet_missing_backends() -> MissingPluginFilter:
    """Install the filter on JAX's backend logger (once); returns it (remove it with
    `logging.getLogger(JAX_BACKEND_LOGGER).removeFilter(...)`). For entry points, which own
    their process's logging; importing paged_jax changes no logging."""
    logger = logging.getLogger(JAX_BACKEND_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, MissingPluginFilter):
            return existing
    quiet = MissingPluginFilter()
    logger.addFilter(quiet)
    return quiet
