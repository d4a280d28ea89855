"""Model loading: where the files are, what the model is, its tokenizer, and its weights."""

from pagedllm.model_executor.loader.model_config import resolve_model_config
from pagedllm.model_executor.loader.model_loader import load_model
from pagedllm.model_executor.loader.tokenizer import load_tokenizer

__all__ = ["load_model", "load_tokenizer", "resolve_model_config"]
