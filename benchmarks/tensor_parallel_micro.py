"""Two numbers of tensor parallelism without a model: the step broadcast (encode + PUB send on rank 0, receive +
decode on a rank) of a decode step of N running requests, and one gloo all-reduce of a [rows, 576] float32
hidden state between two processes.

    PYTHONPATH=. python benchmarks/tensor_parallel_micro.py
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import threading
import time


def decode_step(num_running: int):
    from pagedllm.core.sched_output import CachedRequestData, SchedulerOutput

    cached = [CachedRequestData(f"req-{i}", ([],) if i % 16 else ([1000 + i],), 300 + i) for i in range(num_running)]
    return SchedulerOutput([], cached, {f"req-{i}": 1 for i in range(num_running)}, num_running)


def broadcast(num_running: int, steps: int = 2000) -> tuple[float, float, float, int]:
    import zmq

    from pagedllm.executor.step_broadcast import StepPublisher, StepSubscriber
    from pagedllm.executor.step_broadcast import decode_step as decode

    with tempfile.TemporaryDirectory() as tmp:
        ctx = zmq.Context()
        pub = StepPublisher(ctx, f"ipc://{tmp}/s", f"ipc://{tmp}/a")
        got: list[float] = []

        def rank() -> None:
            sub = StepSubscriber(ctx, 1, f"ipc://{tmp}/s", f"ipc://{tmp}/a")
            while len(got) < steps:
                sub.recv()
                got.append(time.perf_counter())
            sub.close()

        t = threading.Thread(target=rank)
        t.start()
        pub.wait_subscribed(1, 10, lambda: None)
        sched = decode_step(num_running)
        sent = []
        for _ in range(steps):
            sent.append(time.perf_counter())
            pub.send_step(sched)
            time.sleep(0.0005)
        t.join()
        pub.close()
        ctx.term()
        from pagedllm.executor.step_broadcast import encode_step

        payload = encode_step(sched)
        t0 = time.perf_counter()
        for _ in range(steps):
            decode(payload)
        decode_ms = 1000 * (time.perf_counter() - t0) / steps
    send_ms = 1000 * pub.encode_s / pub.num_steps
    latency = statistics.median(1000 * (g - s) for s, g in zip(sent, got))
    return send_ms, decode_ms, latency, len(payload)


def _allreduce_rank(rank: int, port: int, rows: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(rows, 576)
    for _ in range(50):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(1000 * statistics.median(times))
    dist.destroy_process_group()


def all_reduce_ms(rows: int, iters: int = 500) -> float:
    from pagedllm.executor.multiproc_executor import free_tcp_port

    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    port = free_tcp_port()
    procs = [mp.Process(target=_allreduce_rank, args=(r, port, rows, iters, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    value = out.get(timeout=300)
    for p in procs:
        p.join()
    return value


def main() -> None:
    for n in (8, 64, 256):
        send_ms, decode_ms, latency, size = broadcast(n)
        print(f"broadcast of a decode step, {n} running: {size} bytes; encode + send {send_ms:.3f} ms, "
              f"decode {decode_ms:.3f} ms, send -> received (median) {latency:.3f} ms")
    for rows in (1, 8, 256):
        print(f"gloo all-reduce [{rows}, 576] float32, 2 processes: {all_reduce_ms(rows):.3f} ms (median)")


if __name__ == "__main__":
    main()
