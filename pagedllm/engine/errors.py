"""The errors the engine raises to its callers, in one module that every engine file may import.

They used to live beside their first raiser (``async_llm.py``, ``core_client.py``), which made the multiprocess
engine import the asyncio front end for an exception class, and the front end the engine for its type.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop or an engine process died; no request can be served until the server restarts."""


class EngineStartupError(RuntimeError):
    """An engine process failed or exited before it was READY."""


class RequestFailedError(RuntimeError):
    """The model step raised with this request in the batch, also when it was run alone."""
