"""The process of tensor-parallel rank r > 0: its worker (this rank's slice of the model and of the KV heads),
fed by the step broadcast. It returns nothing: rank 0 reports the step's tokens."""

from __future__ import annotations

import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import zmq

from pagedllm.config import EngineConfig
from pagedllm.executor.process_watch import exit_with_parent
from pagedllm.executor.step_broadcast import INIT, STEP, StepSubscriber
from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.worker.worker import Worker

logger = init_logger(__name__)


def run_tp_worker(config: EngineConfig, rank: int, init_method: str, step_address: str, answer_address: str,
                  parent_alive: Connection | None, num_threads: int) -> None:
    """Entry point of rank ``rank`` (a ``multiprocessing`` spawn target): join the group, load this rank's
    weights, size the KV cache, then run every broadcast step until STOP or the engine process going away."""
    if threading.current_thread() is threading.main_thread():  # (a Ray actor may run calls elsewhere)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the engine decides when ranks stop
    if parent_alive is not None:
        exit_with_parent(parent_alive, f"tensor-parallel rank {rank}", "the engine process")
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # before torch starts its pool
    import torch

    torch.set_num_threads(num_threads)
    ctx = zmq.Context()
    sub = StepSubscriber(ctx, rank, step_address, answer_address)
    worker = build_rank_worker(config, rank, init_method)
    torch.set_num_threads(num_threads)
    sub.send_ready(worker.determine_kv_cache_layout().num_blocks)
    serve_steps(worker, sub)
    sub.close()
    ctx.term()


def build_rank_worker(config: EngineConfig, rank: int, init_method: str) -> Worker:
    from pagedllm.worker.worker import Worker

    return Worker(config, tp_rank=rank, tp_init_method=init_method)


def serve_steps(worker: Worker, sub: StepSubscriber) -> None:
    """INIT (allocate the KV cache rank 0 settled on), then one ``execute_model`` per STEP, until STOP."""
    while True:
        kind, message = sub.recv()
        if kind == INIT:
            worker.init_kv_cache(message.layout())
        elif kind == STEP:
            worker.execute_model(message)
        else:
            logger.info("tensor-parallel rank %d: stopping", sub.rank)
            worker.close_parallel()
            return
