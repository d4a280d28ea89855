"""Engine-process entry points that fail on purpose (spawn targets must be importable: they live here)."""

from __future__ import annotations

from typing import Any

from pagedllm.engine.core_proc import run_engine_core


def run_engine_core_failing_after(*args: Any, **kwargs: Any) -> None:
    """An engine whose loop raises on its third model step (a bug, not a bad request: nothing isolates it)."""
    from pagedllm.engine.core_proc import EngineCoreProc

    original = EngineCoreProc._send_outputs
    calls = {"n": 0}

    def send_then_fail(self, outputs):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected engine-loop failure")
        return original(self, outputs)

    EngineCoreProc._send_outputs = send_then_fail
    run_engine_core(*args, **kwargs)


def run_engine_core_failing_at_start(*args: Any, **kwargs: Any) -> None:
    """An engine that cannot build its model."""
    from pagedllm.engine import engine_core

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("injected start-up failure")

    engine_core.EngineCore.__init__ = broken
    run_engine_core(*args, **kwargs)
