"""The transformers fallback (``--model-impl transformers``): any causal LM transformers has, run by pagedllm's
engine with its attention on pagedllm's paged backends. See docs/models.md."""
