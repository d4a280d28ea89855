"""Encoder-decoder requests (Whisper) as the scheduler and the config see them. No torch here.

A request carries its encoder input (``Request.encoder_input``: the log-mel ``audio_features``). The step that
admits it (first admission, or again after a preemption) runs its encoder, which costs
``SchedulerConfig.encoder_tokens_per_request`` positions (1500) of that step's token budget, like prompt tokens:
running decodes are scheduled first, so a burst of new audio takes only what is left and never stalls them.
When even an empty step's budget is smaller than one encoder run, the request is admitted alone in such a step.

Its cross-attention K/V live in a KV cache group of their own (``CacheConfig.cross_group``): the blocks of all
1500 positions, taken at admission, freed when the request ends or is preempted. Prefix caching is off for an
encoder-decoder model: a decoder prompt's blocks are only valid beside the audio they attended to, and the
prompt is a few tokens (nothing worth caching).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.logger import init_logger

logger = init_logger(__name__)


def configure_encoder_decoder(model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig,
                              speculative: Any = None) -> tuple[CacheConfig, SchedulerConfig]:
    """The cache and scheduler settings of an encoder-decoder model (new objects: the configs are frozen), or the
    ones given for any other model; ValueError for what it cannot run."""
    if not model.is_encoder_decoder:
        return cache, scheduler
    if speculative is not None:
        raise ValueError("speculative_config: speculative decoding is not supported for encoder-decoder models "
                         f"({model.architecture})")
    positions = int(model.hf_config.max_source_positions)
    if cache.enable_prefix_caching:
        logger.info("prefix caching is off for %s: its decoder blocks depend on each request's audio",
                    model.architecture)
    return (replace(cache, enable_prefix_caching=False, cross_group_tokens=positions),
            replace(scheduler, encoder_tokens_per_request=positions))


def encoder_cost(request: Any, config: SchedulerConfig) -> int:
    """Encoder positions admitting ``request`` now costs: its encoder runs when it starts from zero."""
    if getattr(request, "encoder_input", None) is None or request.num_computed_tokens:
        return 0
    return config.encoder_tokens_per_request
