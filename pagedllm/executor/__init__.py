"""How an engine core runs its model: one worker in its own process (``uni``), or one worker per
tensor-parallel rank (``mp``: processes on this host; ``ray``: Ray actors in a placement group).
``make_executor`` (``factory.py``) is the one place that chooses; the engine core talks to what it returns as to
an ``Executor`` (``base.py``)."""

from pagedllm.executor.base import Executor, RankDiedError
from pagedllm.executor.factory import (
    EXECUTOR_BACKENDS,
    check_tensor_parallel,
    eager_across_ranks,
    make_executor,
    resolve_executor_backend,
)

__all__ = ["EXECUTOR_BACKENDS", "Executor", "RankDiedError", "check_tensor_parallel", "eager_across_ranks",
           "make_executor", "resolve_executor_backend"]
