"""A process killed while torch built or loaded the kernels leaves torch's lock file behind; the next load
must clear it instead of waiting on it forever (an engine process stopped during start-up did this)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedllm.kernels import cpu

REPO_ROOT = Path(__file__).resolve().parents[2]
LOAD = "import sys; from pagedllm.kernels.cpu import load_cpu_kernels; sys.exit(load_cpu_kernels() is None)"


def test_a_lock_left_by_a_dead_loader_is_removed_not_waited_on() -> None:
    assert cpu.load_cpu_kernels() is not None, "the C++ CPU kernels must build on the test machine"
    folder = cpu.build_directory(cpu.kernels_name())
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder / "lock"
    stale.touch()  # what torch's FileBaton leaves when its holder is SIGKILLed
    # The build path itself, even where a prebuilt library is configured for the suite.
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_CPU_KERNELS_PREBUILT"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    # torch would poll the lock file forever; the timeout turns that hang into a failure.
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left by a process that died" in done.stderr
    assert not stale.exists()


def test_checkouts_in_other_folders_build_apart() -> None:
    folder = cpu.build_directory(cpu.kernels_name())
    # <name>-<hash of the source folder>: a second checkout gets its own folder and never rebuilds this one.
    assert folder.name.startswith(cpu.kernels_name() + "-") and len(folder.name.rsplit("-", 1)[1]) == 8
    assert cpu.build_directory(cpu.kernels_name()) == folder
