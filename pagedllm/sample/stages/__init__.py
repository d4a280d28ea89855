"""The sampler's logits stages, by family: token masks (allowed tokens, min_tokens, grammar), penalties (logit
bias, presence/frequency/repetition), the distribution's shape (temperature, top-k/top-p, min-p). A model's own
rules (Whisper's, ``sample/whisper_rules.py``) are not here: the worker puts them first for the models that have
them."""

from __future__ import annotations

from pagedllm.sample.stage_base import LogitsStage
from pagedllm.sample.stages.distribution import MinPStage, TemperatureStage, TopKTopPStage
from pagedllm.sample.stages.penalties import LogitBiasStage, PenaltiesStage
from pagedllm.sample.stages.token_masks import AllowedTokensStage, GrammarBitmaskStage, MinTokensStage

__all__ = ["AllowedTokensStage", "GrammarBitmaskStage", "LogitBiasStage", "LogitsStage", "MinPStage",
           "MinTokensStage", "PenaltiesStage", "TemperatureStage", "TopKTopPStage", "default_stages"]


def default_stages() -> list[LogitsStage]:
    """The processing order: the tokens a request allows, what the request asked for (bias, min_tokens, penalties,
    grammar), then the distribution's shape (temperature, truncation). The grammar comes before truncation so
    top-k/top-p pick among allowed tokens only."""
    return [AllowedTokensStage(), LogitBiasStage(), MinTokensStage(), PenaltiesStage(), GrammarBitmaskStage(),
            TemperatureStage(), TopKTopPStage(), MinPStage()]
