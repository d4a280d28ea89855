"""The scheduling brain and the routing pieces load no torch: a router or API process can import them cheaply."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = ["pagedllm.core.kv_cache_manager", "pagedllm.core.scheduler", "pagedllm.core.block_hash",
           "pagedllm.core.kv_events", "pagedllm.config", "pagedllm.distributed.kv_events",
           "pagedllm.engine.router"]


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_without_torch(module):
    # A fresh interpreter: this test process has torch loaded already.
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
