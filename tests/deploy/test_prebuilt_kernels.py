"""Container images ship the C++ kernels built ahead of time (PAGEDLLM_CPU_KERNELS_PREBUILT); the runtime image
has no compiler, so loading must not start a build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.kernels import cpu as cpu_kernels

from helpers.deploy_checks import REPO_ROOT

CHECK = """
import torch
from pagedllm.kernels.cpu import load_cpu_kernels
k = load_cpu_kernels()
assert k is not None, "prebuilt kernels did not load"
gate_up = torch.randn(3, 8)
want = torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:]
torch.testing.assert_close(k.silu_and_mul(gate_up), want)
print(k.__file__)
"""


def run_with(prebuilt: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PAGEDLLM_CPU_KERNELS_PREBUILT": str(prebuilt),
           # No compiler and an empty extensions folder: any attempt to build would fail loudly.
           "CXX": "/nonexistent/c++", "PATH": "/nonexistent", "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)


def test_prebuilt_library_loads_without_a_build(tmp_path: Path):
    built = cpu_kernels.load_cpu_kernels()
    if built is None:
        pytest.skip("this machine cannot build the CPU kernels (no compiler), so there is no library to ship")
    ship = tmp_path / "kernels"
    ship.mkdir()
    shutil.copy(built.__file__, ship)
    for prebuilt in (ship, ship / Path(built.__file__).name):  # the folder (as the image sets it) or the file
        result = run_with(prebuilt, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip().startswith(str(ship)), result.stdout
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())


def test_unusable_prebuilt_path_falls_back_to_torch(tmp_path: Path, monkeypatch):
    # A wrong path costs speed, not correctness: the torch paths take over, with a warning that says why.
    warnings: list[str] = []
    monkeypatch.setattr(cpu_kernels.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    (tmp_path / "two").mkdir()
    for name in ("pagedllm_cpu_kernels_a.so", "pagedllm_cpu_kernels_b.so"):
        (tmp_path / "two" / name).write_bytes(b"")
    (tmp_path / "pagedllm_cpu_kernels_c.so").write_bytes(b"not a library")
    for path in (tmp_path / "missing", tmp_path / "two", tmp_path / "pagedllm_cpu_kernels_c.so"):
        assert cpu_kernels._load_prebuilt(path) is None
    assert len(warnings) == 3 and "does not exist" in warnings[0] and "found 2" in warnings[1], warnings
    assert all("slower torch paths" in w for w in warnings)
