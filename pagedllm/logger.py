"""One logger setup for the whole package (``pagedllm.*`` loggers)."""

from __future__ import annotations

import logging
import sys

from pagedllm import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """Return the package logger ``name``, configuring the root ``pagedllm`` logger once."""
    global _configured
    if not _configured:
        root = logging.getLogger("pagedllm")
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(envs.PAGEDLLM_LOGGING_LEVEL.upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
