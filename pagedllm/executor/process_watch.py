"""Seeing the other end of a process pair die, both ways round (standard library only).

A parent starts children (engine processes, tensor-parallel ranks) and must notice, within milliseconds, one
that exits without a word (SIGKILL, the OOM killer): ``SentinelWatcher`` waits on their process sentinels. A
child must not outlive its parent, even one killed by SIGKILL, which runs no clean-up: ``exit_with_parent``
watches a pipe whose other end only the parent holds.

Both the executor (``multiproc_executor.py``, ``tp_worker_proc.py``) and the engine above it
(``engine/core_client.py``, ``engine/core_proc.py``) use these, so they live here, where both can import them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Protocol

from pagedllm.logger import init_logger

logger = init_logger(__name__)


class Watchable(Protocol):
    """What a watched child offers: a ``multiprocessing.Process``, or a Ray call seen as one (``ActorCall``)."""

    sentinel: int
    pid: int | None

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...


def describe_exit(proc: Watchable) -> str:
    """"killed by signal 9" or "exited with status 1": how a child ended, for a log line or an error."""
    code = proc.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"


class SentinelWatcher:
    """A daemon thread that waits until one of ``processes`` ends, then calls ``on_exit(index, process)`` once,
    from that thread; ``stop()`` (the parent shutting its children down on purpose) ends it without a call.

    ``join_s``: how long to wait for the process's exit status before reporting (its sentinel becomes readable
    a moment before the status is known)."""

    def __init__(self, processes: Sequence[Watchable], on_exit: Callable[[int, Any], None], name: str,
                 join_s: float = 1.0) -> None:
        self._processes = list(processes)
        self._on_exit = on_exit
        self._join_s = join_s
        self._stopped = False
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        ready = wait_for_sentinels([*sentinels, self._stop_r])
        if self._stopped or self._stop_r in ready:
            return
        index = sentinels[next(s for s in ready if s in sentinels)]
        proc = self._processes[index]
        proc.join(self._join_s)
        self._on_exit(index, proc)

    def stop(self, timeout: float = 2.0) -> None:
        """End the watch without reporting (idempotent); waits up to ``timeout`` s for the thread."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._stop_w, b"x")
        self._thread.join(timeout)
        os.close(self._stop_w)
        os.close(self._stop_r)


def exit_with_parent(parent_alive: Connection, who: str, parent: str,
                     on_exit: Callable[[], None] | None = None) -> None:
    """End this process when its parent dies (even by SIGKILL): the parent's end of the pipe closes, recv fails.
    ``who`` / ``parent`` name both in the log line ("engine 0", "the API process"); ``on_exit`` runs first."""

    def watch() -> None:
        try:
            parent_alive.recv()
        except (EOFError, OSError):
            pass
        logger.warning("%s: %s is gone; exiting", who, parent)
        if on_exit is not None:
            on_exit()
        os._exit(0)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()
