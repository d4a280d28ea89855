"""A real ``pagedllm serve`` subprocess on a free loopback port, always stopped at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, extra_args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-serve-{self.port}.log"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
               # float32 everywhere (auto is bf16 on AVX-512 bf16 CPUs): tests compare outputs exactly.
               "--dtype", "float32",
               "--uvicorn-log-level", "warning", *extra_args]
        full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     cwd=REPO_ROOT)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def client(self, api_key: str = "EMPTY", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def async_client(self, api_key: str = "EMPTY"):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def remote_server_cls() -> type[RemoteServer]:
    """For modules that need a server with other flags (they must stop it themselves)."""
    return RemoteServer


@pytest.fixture(scope="session")
def server() -> Iterator[RemoteServer]:
    srv = RemoteServer(["--served-model-name", "test-model"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def client(server: RemoteServer):
    return server.client()


@pytest.fixture(scope="session")
def model_name() -> str:
    return "test-model"
