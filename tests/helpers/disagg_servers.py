"""Processes for the disaggregation tests: ``pagedllm serve`` instances and ``pagedllm proxy`` on free loopback
ports, with their metrics read back."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-{name}-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.log_path} did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def serve(name: str, kv_transfer_config: dict) -> Process:
    return Process(name, ["serve", "--served-model-name", "test-model", "--kv-cache-memory", "96MiB",
                          "--max-model-len", "2048", "--dtype", "float32", "--disable-frontend",
                          "--kv-transfer-config", json.dumps(kv_transfer_config)],
                   # One thread each: two engines on a 2-core CI machine must not fight over both cores.
                   env={"OMP_NUM_THREADS": "1"})


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples on ``url``/metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_for(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
