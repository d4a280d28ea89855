"""The model runner's pooling path: compute prompts, pool their hidden states, sample nothing.

Encoder models (BERT) get whole prompts, positions from 0 and no KV cache; decoder models used as embedders
run through the normal paged path (their KV blocks live until the request finishes), possibly in chunks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.attention.forward_context import forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model_executor.layers.pooler import Pooler

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import CachedRequestState, ModelRunner

logger = logging.getLogger(__name__)


def log_pooling_setup(mc: Any) -> None:
    """Say at start-up how embeddings are computed: pooling, normalisation and, above all, the dtype."""
    pc = mc.pooler_config
    if mc.dtype == "float32":
        precision = "float32"
    elif mc.is_encoder_only:
        precision = f"{mc.dtype} matmuls and attention, float32 residual stream and LayerNorms"
    else:
        precision = mc.dtype
    logger.info("pooling runner: %s pooling%s; embeddings computed in %s%s", pc.pooling_type,
                ", normalised" if pc.normalize else "", precision,
                "" if mc.dtype == "float32" else " (--dtype float32 for full float32)")


def encoder_inputs(states: list[CachedRequestState], query_lens: list[int], device: torch.device
                   ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Flat ids and per-sequence positions of whole prompts, and metadata holding only their offsets."""
    ids: list[int] = []
    for state, q in zip(states, query_lens):
        ids.extend(state.token_ids[:q])
    positions = torch.cat([torch.arange(q) for q in query_lens])
    meta = AttentionMetadata.encoder_only(query_lens, device)
    return meta, torch.tensor(ids, dtype=torch.long, device=device), positions.to(device)


class PoolingRunner:
    def __init__(self, pooler: Pooler, is_encoder_only: bool) -> None:
        self.pooler = pooler
        self.is_encoder_only = is_encoder_only
        self._partial: dict[str, torch.Tensor] = {}  # req_id -> accumulated earlier chunks

    def execute(self, runner: ModelRunner, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._partial.pop(req_id, None)
        # Decodes first, as the paged attention metadata expects (one-token prompts or last chunks).
        order = sorted(sched.num_scheduled_tokens, key=lambda r: sched.num_scheduled_tokens[r] != 1)
        states = [runner.requests[r] for r in order]
        query_lens = [sched.num_scheduled_tokens[r] for r in order]
        if self.is_encoder_only:
            meta, input_ids, positions = encoder_inputs(states, query_lens, runner.device)
        else:
            meta, input_ids, positions = runner._prepare_inputs(states, query_lens)
        runner.prepare_attention(meta)
        with forward_context(meta):
            hidden = runner.model(input_ids, positions)

        chunk_starts = [s.num_computed_tokens for s in states]
        partial = {i: self._partial.pop(s.req_id) for i, s in enumerate(states)
                   if s.req_id in self._partial and chunk_starts[i] > 0}
        pooled = self.pooler.pool_chunks(hidden, meta.query_start_loc_cpu, chunk_starts, partial)
        done = []
        for i, state in enumerate(states):
            state.num_computed_tokens += query_lens[i]
            if state.num_computed_tokens >= len(state.prompt_token_ids):
                done.append(i)
            else:
                self._partial[state.req_id] = pooled[i].clone()
        result = ModelRunnerOutput(sampled_token_ids={})
        if not done:
            return result
        done_states = [states[i] for i in done]
        params = [s.pooling_params for s in done_states]
        vectors = self.pooler.finish(
            pooled[done], [len(s.prompt_token_ids) for s in done_states],
            [self.pooler.normalize if p.normalize is None else p.normalize for p in params],
            [p.dimensions for p in params])
        for state, vec in zip(done_states, vectors):
            result.pooler_output[state.req_id] = vec
        return result
