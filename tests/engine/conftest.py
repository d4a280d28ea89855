import pytest

from pagedllm import LLM


# float32 pinned: exact batched == solo equality is a float32 property. On CPUs with AVX-512 bf16, "auto"
# resolves to bf16, whose matmuls round differently by batch shape and can flip near-tied greedy tokens.
@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(kv_cache_memory="64MiB", max_model_len=1024, dtype="float32")
