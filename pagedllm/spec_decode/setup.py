"""Check a speculative config against the target model and resolve the draft model (engine start-up)."""

from __future__ import annotations

from typing import Any

from pagedllm.config import ModelConfig
from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config


def resolve_speculative_config(raw: Any, target: ModelConfig) -> SpeculativeConfig | None:
    """Parse ``raw`` (JSON / dict / None) and check it fits ``target`` (a resolved ModelConfig).

    For ``draft_model`` the draft's ModelConfig is resolved here (same dtype and context length as the
    target); its vocabulary must equal the target's, since drafts are verified token id by token id.
    """
    cfg = parse_speculative_config(raw)
    if cfg is None:
        return None
    if cfg.method == "layer_skip":
        if target.model_impl == "transformers":
            raise ValueError(f"speculative_config.method: layer_skip runs a native model's first layers; "
                             f"{target.architecture} runs through the transformers fallback (use ngram)")
        num_layers = getattr(target.hf_config, "num_hidden_layers", None)
        if num_layers is not None and cfg.num_draft_layers >= num_layers:
            raise ValueError(f"speculative_config.num_draft_layers: {cfg.num_draft_layers} must be smaller than "
                             f"the target model's {num_layers} layers")
    elif cfg.method == "draft_model":
        from pagedllm.model_executor.loader import resolve_model_config

        try:
            draft = resolve_model_config(ModelConfig(model=cfg.model, dtype=target.dtype,
                                                     max_model_len=target.max_model_len, seed=target.seed,
                                                     device=target.device))
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens) differs "
                             f"from the target's ({target.vocab_size}); it must use the same tokenizer")
        cfg.draft_model_config = draft
    return cfg


def attach_spec_decoder(runner: Any, cfg: SpeculativeConfig, device: Any) -> None:
    """Give a ModelRunner its SpecDecoder (loading the draft model, whose KV the runner then sizes)."""
    from pagedllm.logger import init_logger
    from pagedllm.spec_decode.spec_decoder import SpecDecoder

    draft = None
    if cfg.method == "draft_model":
        from pagedllm.model_executor.loader import load_model

        draft = load_model(cfg.draft_model_config, device)
        runner.draft_model = draft
    runner.spec_decoder = SpecDecoder(cfg, runner.model, draft, runner.block_size, device)
    detail = {"ngram": f"prompt lookup n={cfg.prompt_lookup_min}..{cfg.prompt_lookup_max}",
              "draft_model": f"draft model {cfg.model}",
              "layer_skip": f"the first {cfg.num_draft_layers} layers",
              "suffix": f"suffix trees of depth {cfg.suffix.max_tree_depth} over each request and the last "
                        f"{cfg.suffix.max_cached_requests} outputs"}[cfg.method]
    init_logger(__name__).info("speculative decoding: %s, %d tokens per step (%s)%s", cfg.method,
                               cfg.num_speculative_tokens, detail,
                               f", off in steps with more than {cfg.disable_by_batch_size} requests"
                               if cfg.disable_by_batch_size else "")
