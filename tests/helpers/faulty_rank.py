"""Tensor-parallel ranks that die (SIGKILL-like ``os._exit``) in the middle of a step or before they join the
group, for the fault tests."""

from __future__ import annotations

import os
from typing import Any

from pagedllm.executor import tp_worker_proc


def run_dying_rank(*args: Any) -> None:
    """``run_tp_worker`` whose rank exits inside its third step's forward (its peers wait in an all-reduce)."""
    real = tp_worker_proc.serve_steps

    def serve(worker: Any, sub: Any) -> None:
        steps = {"n": 0}
        run = worker.execute_model

        def execute(sched: Any, overlap: Any = None) -> Any:
            if not sched.is_empty:
                steps["n"] += 1
                if steps["n"] == 3:
                    os._exit(9)
            return run(sched, overlap)

        worker.execute_model = execute
        real(worker, sub)

    tp_worker_proc.serve_steps = serve
    tp_worker_proc.run_tp_worker(*args)


def run_rank_dying_before_it_joins(*args: Any) -> None:
    """A rank whose process exits at start-up, before it reaches the group (an import error, OOM-killed)."""
    os._exit(7)
