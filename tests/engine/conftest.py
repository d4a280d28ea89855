import pytest

from pagedllm import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(kv_cache_memory="64MiB", max_model_len=1024)
