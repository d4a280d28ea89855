"""Environment variables pagedllm reads at the top level, each documented with its feature.

Read here, once, and passed down as configuration; nothing deep in the engine reads the environment itself.
"""

from __future__ import annotations

import os


def enable_multiprocessing() -> bool:
    """``PAGEDLLM_ENABLE_MULTIPROCESSING=0`` runs the server's engine core on a thread of the API process instead
    of in its own process (vLLM: ``VLLM_ENABLE_V1_MULTIPROCESSING``); for debugging with one interpreter."""
    return os.environ.get("PAGEDLLM_ENABLE_MULTIPROCESSING", "1").strip().lower() not in ("0", "false", "no", "off")
