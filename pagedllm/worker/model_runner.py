"""SchedulerOutput → flat batch tensors → model → sampler → ModelRunnerOutput.

The runner keeps its own copy of each running request (tokens, block ids, generator) and applies the
scheduler's diffs to it, so per step only new tokens and new block ids travel.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from pagedllm.attention.forward_context import forward_context
from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata, link_groups, token_positions
from pagedllm.attention.spec import common_sliding_window, kv_cache_groups
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.host_to_device import index_rows, tensor_on, to_device
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.attention import (
    StepReaders,
    attention_layers,
    bind_kv_caches,
    prepare_step_states,
    step_readers,
)
from pagedllm.platforms import platform_for
from pagedllm.platforms.cpu_memory import zeroed_host_tensor
from pagedllm.sample.batch_state import SamplingBatch
from pagedllm.sample.sampler import Sampler, compute_logprobs_for_targets, logprob_dicts
from pagedllm.sample.stage_base import LogitsStage
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import resolve_bitmask

logger = init_logger(__name__)

# Rows of the reused logits buffer (a decode step samples one row per running request).
LOGITS_BUFFER_ROWS = 256
# Prompt logprobs take the logits of a chunk's positions this many at a time: a whole chunk at once would
# need [max_num_batched_tokens, vocab] float32 (and its log-softmax), a peak the GPU KV sizing does not
# profile (worker/profile_step.py profiles max_num_seqs sampled rows).
PROMPT_LOGPROBS_ROWS = 256


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool) -> torch.Tensor:
    """A zeroed tensor; on CPU on its own mapping, written whole now (prefault) or backed as blocks are used.

    Zeros (not empty) matter: padded positions are masked, but NaN garbage would still poison SDPA.
    """
    return platform_for(device).zeros(shape, dtype, device, prefault)


def _grammar_rows(sched: SchedulerOutput, sample_states: list[CachedRequestState]
                  ) -> tuple[list[int], torch.Tensor | None]:
    """The sampling rows under a grammar and their rows of the step's bitmask [M, ceil(V/32)] int32."""
    if not sched.structured_output_request_ids:
        return [], None
    index = {req_id: i for i, req_id in enumerate(sched.structured_output_request_ids)}
    rows, picks = [], []
    for row, state in enumerate(sample_states):
        if state.req_id in index:
            rows.append(row)
            picks.append(index[state.req_id])
    if not rows:
        return [], None
    bitmask = torch.as_tensor(resolve_bitmask(sched.grammar_bitmask))  # waits for an overlapped fill
    return rows, bitmask if picks == list(range(len(index))) else bitmask[picks]


def _kv_spec(model: nn.Module) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_size) of ``model``'s attention layers that keep a KV cache."""
    layers = [m for m in attention_layers(model) if m.spec.uses_kv_cache]
    if not layers:
        return 0, 1, 1
    return len(layers), layers[0].num_kv_heads, layers[0].head_size


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + outputs so far
    params: SamplingParams
    block_ids: tuple[list[int], ...]  # the block table in each KV cache group
    num_computed_tokens: int
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: Any = None  # PoolingParams of a pooling request
    mm_features: list = field(default_factory=list)  # its images (core/multimodal.py), with their pixels
    lora: Any = None  # its LoRA adapter (lora.request.AdapterRef), None for the base model
    mrope: Any = None  # an M-RoPE model's (prompt positions [3, L], decode delta), made at its first step


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                 vocab_size: int, eos_token_ids: list[int], pooling: Any = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.pooling = pooling  # a PoolingRunner when the engine runs a pooling model (no sampling)
        self.device = device
        self.platform = platform_for(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV cache's (--kv-cache-dtype)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # The requests' sampling state, kept across steps; the sampler applies the same stage objects.
        self.sampling = SamplingBatch(vocab_size, eos_token_ids, device)
        self.sampler = Sampler(self.sampling.stages)
        self.requests: dict[str, CachedRequestState] = {}
        # Generators outlive preemption so a seeded request resumes its random stream where it was.
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[torch.Tensor] = []
        self._logits_buffer: torch.Tensor | None = None
        # Recorded step graphs, CUDA or CPU (worker.capture_decode_graphs): decodes, and on the CPU draft
        # verification too; None runs every step eagerly.
        self.decode_graphs: Any = None
        # Speculative decoding (spec_decode/): set by the worker when configured. A separate draft model
        # gets its own per-layer caches over the same block ids.
        self.spec_decoder: Any = None
        self.draft_model: nn.Module | None = None
        self.draft_kv_caches: list[torch.Tensor] = []
        # An encoder-decoder model (worker/encoder_decoder.py): runs new requests' encoders, builds the
        # cross-attention group's metadata. None for every other model.
        self.encoder_decoder: Any = None
        # A vision-language model (worker/multimodal_runner.py): the encoder cache and image-row merging; else None.
        self.multimodal: Any = None
        if getattr(model, "supports_multimodal", False):
            from pagedllm.worker.multimodal_runner import MultiModalRunner

            self.multimodal = MultiModalRunner(model)
            logger.info("multimodal model: images encoded once each, their outputs kept in an encoder cache keyed "
                        "by image content")
        # The layers that read a step's metadata, by group and backend (step_readers); found at the first step
        # after the KV caches are bound (which sets each layer's group).
        self._step_readers: StepReaders | None = None
        # LoRA adapters (lora/model_manager.py): set by the worker with --enable-lora; None runs the base model only.
        self.lora: Any = None

    def add_model_rules_stage(self, stage: LogitsStage) -> None:
        """A model's own decoding rules (Whisper's, ``sample/whisper_rules.py``) as the sampler's first stage, ahead
        of the request-driven ones; the worker adds it before any request joins."""
        if len(self.sampling):
            raise RuntimeError("add_model_rules_stage: requests already hold sampling state")
        self.sampling = SamplingBatch(self.vocab_size, self.eos_token_ids, self.device, [stage, *self.sampling.stages])
        self.sampler = Sampler(self.sampling.stages)

    # ---- KV cache ----------------------------------------------------------------------------------
    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_size) of the model's attention layers that keep a KV cache."""
        return _kv_spec(self.model)

    def kv_sliding_window(self) -> int | None:
        """The window when every cached layer slides with it (the KV cache manager may then free blocks
        that fell out of it); None otherwise."""
        return common_sliding_window([m.spec for m in attention_layers(self.model)])

    def kv_cache_groups(self) -> tuple[list[int], int | None]:
        """(KV cache group of each cached layer, the sliding group's window or None): two groups only for a
        hybrid model whose sliding layers share one window (attention/spec.py ``kv_cache_groups``)."""
        return kv_cache_groups([m.spec for m in attention_layers(self.model)])

    def bytes_per_block(self, group: int | None = None) -> int:
        """Bytes of one block over all layers (the draft model's layers included); with ``group``, over that
        KV cache group's layers only (a draft model's layers all index group 0's blocks)."""
        total = 0
        for model in (self.model, self.draft_model):
            if model is not None:
                num_layers, num_kv_heads, head_size = _kv_spec(model)
                if group is not None and model is self.model:
                    num_layers = sum(1 for g in self.kv_cache_groups()[0] if g == group)
                elif group:
                    num_layers = 0
                total += 2 * num_layers * self.block_size * num_kv_heads * head_size * self.kv_dtype.itemsize
        return total

    def init_kv_cache(self, num_blocks: int, sliding_group_num_blocks: int = 0, prefault: bool = False) -> None:
        """Allocate per layer [2, num_blocks, block_size, Hkv, D] and bind it to the attention layers; the
        layers of a hybrid model's sliding group get ``sliding_group_num_blocks`` blocks (0: num_blocks).
        ``prefault``: every page resident now (CPU; --kv-cache-prefault)."""
        num_layers, num_kv_heads, head_size = self.kv_cache_spec()
        groups = self.kv_cache_groups()[0]
        group_blocks = (num_blocks, sliding_group_num_blocks or num_blocks)
        # Shown only when writing the pages takes long (seconds per GiB where the host backs memory on first touch).
        layers = tqdm(groups, desc="Writing the KV cache", unit="layer", delay=2, leave=False, disable=not prefault,
                      dynamic_ncols=True)
        self.kv_caches = [_zeros((2, group_blocks[g], self.block_size, num_kv_heads, head_size), self.kv_dtype,
                                 self.device, prefault) for g in layers]
        bind_kv_caches(self.model, self.kv_caches, groups)
        self._step_readers = None  # the layers' groups may have changed
        if self.draft_model is not None:
            num_layers, num_kv_heads, head_size = _kv_spec(self.draft_model)
            shape = (2, num_blocks, self.block_size, num_kv_heads, head_size)
            self.draft_kv_caches = [_zeros(shape, self.kv_dtype, self.device, prefault) for _ in range(num_layers)]
            bind_kv_caches(self.draft_model, self.draft_kv_caches)

    def release_kv_cache(self) -> None:
        """Drop the KV cache tensors (after the GPU profiling step) and unbind them from the layers (the draft
        model's too: a cache still bound to a layer would keep its memory)."""
        self.kv_caches = []
        self.draft_kv_caches = []
        for model in (self.model, self.draft_model):
            for layer in attention_layers(model) if model is not None else []:
                layer.kv_cache = None

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """A reused [rows, vocab] float32 buffer for this step's logits on CPU, or None (allocate fresh).

        At 200 rows of a 49k vocabulary the logits are ~40 MB; a fresh tensor every step paid page faults and
        TLB misses in the LM head (measured: docs/performance.md), a reused one on huge pages does not. Big
        prompt-logprob batches (over LOGITS_BUFFER_ROWS rows) still allocate, so the buffer stays small.
        """
        if not self.platform.reuses_logits_buffer or rows > LOGITS_BUFFER_ROWS:
            return None
        if self._logits_buffer is None:
            self._logits_buffer = zeroed_host_tensor((LOGITS_BUFFER_ROWS, self.vocab_size), torch.float32,
                                                     huge_pages=True)
        return self._logits_buffer[:rows]

    # ---- state updates -----------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
            if self.spec_decoder is not None:
                self.spec_decoder.forget(req_id)
        for req_id in sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        added = []
        for new in sched.scheduled_new_reqs:
            gen = self.generators.get(new.req_id)
            if gen is None and new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
                self.generators[new.req_id] = gen
            state = self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=new.prompt_token_ids,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids), params=new.sampling_params,
                block_ids=tuple(list(ids) for ids in new.block_ids), num_computed_tokens=new.num_computed_tokens,
                generator=gen,
                output_token_ids=list(new.output_token_ids), pooling_params=new.pooling_params,
                mm_features=list(new.mm_features), lora=new.lora)
            if self.pooling is None:
                added.append((new.req_id, state.params, state.prompt_token_ids, state.output_token_ids, gen))
        if self.pooling is None:
            self.sampling.update(removed=[*sched.finished_req_ids, *sched.preempted_req_ids], added=added)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for table, new_ids in zip(state.block_ids, cached.new_block_ids):
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, overlap: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """One step. ``overlap``, if given, is called once the step's sampling is queued on the device and
        before the host waits for its tokens: on a GPU, host work done there hides behind the step's kernels.
        Steps that sample nothing do not call it (the caller does, after)."""
        self._update_states(sched)
        if self.multimodal is not None:
            self.multimodal.free(sched.free_encoder_hashes)
        if sched.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        began = time.perf_counter()
        if self.pooling is not None:
            return self.pooling.execute(self, sched)
        # Decodes (one token) first: the attention backend batches them in one call.
        order = sorted(sched.num_scheduled_tokens, key=lambda r: sched.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        query_lens = [sched.num_scheduled_tokens[r] for r in order]
        spec = sched.scheduled_spec_decode_tokens
        meta, input_ids, positions = self._prepare_inputs(states, query_lens, spec)
        if self.multimodal is not None and self.multimodal.uses_mrope:
            positions = self.multimodal.mrope_positions(states, query_lens, positions)
        if self.multimodal is not None and self.multimodal.bidirectional:
            self.multimodal.mark_bidirectional_runs(meta, states, query_lens)
        if self.encoder_decoder is not None:
            self.encoder_decoder.run_encoders(sched)  # new requests' cross-attention K/V, before the decoder reads

        # A step with image tokens: their rows come from the encoder cache (images encoded first, if new).
        inputs_embeds = (self.multimodal.input_embeddings(states, query_lens, input_ids)
                         if self.multimodal is not None else None)

        adapters = [state.lora for state in states] if self.lora is not None else []
        with_adapters = any(adapters)
        if (inputs_embeds is None and (not with_adapters or self.lora.graphs_hold_adapters)
                and self.decode_graphs is not None and self.decode_graphs.can_run(meta)):
            if with_adapters:  # each row's slot, read by the recorded LoRA kernel calls
                self.lora.begin_step(adapters, query_lens)
            try:
                hidden = self.decode_graphs.run(input_ids, positions, meta)  # a CUDA or CPU step graph replayed
            finally:
                if with_adapters:
                    self.lora.end_step()
        elif with_adapters:
            self.lora.begin_step(adapters, query_lens)  # the adapters' slots and rows
            try:
                self.prepare_attention(meta)
                with forward_context(meta):
                    hidden = (self.model(input_ids, positions) if inputs_embeds is None
                              else self.model(input_ids, positions, inputs_embeds=inputs_embeds))
            finally:
                self.lora.end_step()
        else:
            self.prepare_attention(meta)
            with forward_context(meta):
                hidden = (self.model(input_ids, positions) if inputs_embeds is None
                          else self.model(input_ids, positions, inputs_embeds=inputs_embeds))

        # Only the last token of a request that has caught up with all its tokens samples.
        qsl = meta.query_start_loc_cpu
        sample_rows, sample_states = [], []
        prompt_lp_jobs = []
        verify_jobs = []  # (state, drafts, first logits row) of requests verifying drafts
        verify_rows: list[int] = []
        for i, state in enumerate(states):
            end = state.num_computed_tokens + query_lens[i]
            if state.params.prompt_logprobs is not None and state.num_computed_tokens < len(state.prompt_token_ids):
                prompt_lp_jobs.append((i, state))
            drafts = spec.get(state.req_id)
            if drafts:
                # Rows of the last real token and of each draft: k + 1 target distributions.
                verify_jobs.append((state, drafts, len(verify_rows)))
                verify_rows.extend(range(qsl[i + 1] - 1 - len(drafts), qsl[i + 1]))
            elif end >= len(state.token_ids):
                sample_rows.append(qsl[i + 1] - 1)
                sample_states.append(state)

        result = ModelRunnerOutput(sampled_token_ids={})
        if prompt_lp_jobs:
            self._prompt_logprobs(prompt_lp_jobs, hidden, qsl, query_lens, result)
        starts = [state.num_computed_tokens for state in states]
        for i, state in enumerate(states):
            state.num_computed_tokens += query_lens[i]
        if verify_jobs:
            self._verify(hidden, verify_rows, verify_jobs, result)
        if sample_rows:
            self._sample(hidden, sample_rows, sample_states, result, sched, overlap)
        if self.spec_decoder is not None:
            result.spec_token_ids = self.spec_decoder.propose(states, starts, query_lens,
                                                              set(result.sampled_token_ids))
            decoding = len(result.sampled_token_ids) == len(states) and all(
                q == 1 + len(spec.get(state.req_id, ())) for q, state in zip(query_lens, states))
            if decoding:  # what the draft governor compares: tokens per second with and without drafts
                self.spec_decoder.observe_step(len(states), sum(map(len, result.sampled_token_ids.values())),
                                               time.perf_counter() - began, bool(verify_jobs), sum(query_lens))
            result.spec_governor_decisions = self.spec_decoder.governor.decision_counts()
        return result

    def _verify(self, hidden: torch.Tensor, rows: list[int], jobs: list, result: ModelRunnerOutput) -> None:
        """Check drafts against the target (spec_decode/); keep the accepted ones, roll back the rest."""
        logits = self.model.compute_logits(hidden[rows], out=self._logits_out(len(rows)))
        tokens, logprobs = self.spec_decoder.verify(logits, jobs, self.sampling, self.sampler)
        for (state, drafts, _), new, entries in zip(jobs, tokens, logprobs):
            state.token_ids.extend(new)
            state.output_token_ids.extend(new)
            state.num_computed_tokens -= len(drafts) + 1 - len(new)  # rejected drafts' K/V is stale
            result.sampled_token_ids[state.req_id] = new
            if entries is not None:
                result.logprobs[state.req_id] = entries

    def _sample(self, hidden: torch.Tensor, sample_rows: list[int], sample_states: list[CachedRequestState],
                result: ModelRunnerOutput, sched: SchedulerOutput, overlap: Callable[[], None] | None = None) -> None:
        # Valid until the next compute_logits call: the sampler reads it and keeps nothing of it.
        logits = self.model.compute_logits(index_rows(hidden, sample_rows), out=self._logits_out(len(sample_rows)))
        grammar_rows, grammar_bitmask = _grammar_rows(sched, sample_states)
        sampling_meta = self.sampling.metadata([s.req_id for s in sample_states], grammar_rows=grammar_rows,
                                               grammar_bitmask=grammar_bitmask)
        out = self.sampler(logits, sampling_meta)
        if overlap is not None:
            overlap()
        sampled = out.sampled_token_ids.tolist()  # the host waits for the device here
        entries = None
        if out.logprobs is not None:
            entries = logprob_dicts(out.logprobs, [s.params.logprobs or 0 for s in sample_states])
        for row, state in enumerate(sample_states):
            token = sampled[row]
            state.token_ids.append(token)
            state.output_token_ids.append(token)
            result.sampled_token_ids[state.req_id] = [token]
            if entries is not None and state.params.logprobs is not None:
                result.logprobs[state.req_id] = [entries[row]]

    def prepare_attention(self, meta: AttentionMetadata) -> None:
        """The attention backends' per-step state for an eagerly run step (built once, not by the first layer)."""
        if self._step_readers is None:
            self._step_readers = step_readers(self.model)
        prepare_step_states(meta, self._step_readers)

    def _prepare_inputs(self, states: list[CachedRequestState], query_lens: list[int],
                        spec: dict[str, list[int]] | None = None
                        ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        seq_lens = [state.num_computed_tokens + q for state, q in zip(states, query_lens)]
        metas = []
        for group in range(len(states[0].block_ids)):  # one metadata per KV cache group
            if self.encoder_decoder is not None and group == self.encoder_decoder.group:
                metas.append(self.encoder_decoder.cross_metadata([s.block_ids[group] for s in states], metas[0]))
                continue
            width = max(len(s.block_ids[group]) for s in states)
            tables = np.zeros((len(states), width), dtype=np.int32)
            for i, state in enumerate(states):
                tables[i, :len(state.block_ids[group])] = state.block_ids[group]
            metas.append(build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.device))
        meta = link_groups(metas)  # each layer picks its group's (attention/forward_context.py)
        ids: list[int] = []
        for state, q in zip(states, query_lens):
            start = state.num_computed_tokens
            drafts = spec.get(state.req_id, []) if spec else []  # verified after the request's own tokens
            ids.extend(state.token_ids[start:start + q - len(drafts)])
            ids.extend(drafts)
        input_ids = tensor_on(ids, torch.long, self.device)
        positions = to_device(torch.from_numpy(token_positions(query_lens, seq_lens)), self.device)
        return meta, input_ids, positions

    def _prompt_logprobs(self, jobs, hidden: torch.Tensor, qsl: list[int], query_lens: list[int],
                         result: ModelRunnerOutput) -> None:
        """Logprobs of each prompt token given the tokens before it, for the chunk computed now."""
        for i, state in jobs:
            start = state.num_computed_tokens
            num_prompt = len(state.prompt_token_ids)
            # Positions start..end-1 predict tokens start+1..end; stop at the last prompt token.
            end = min(start + query_lens[i], num_prompt - 1)
            entries: list[dict[int, tuple[float, int]]] = []
            k = state.params.prompt_logprobs
            for lo in range(start, end, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
                rows = hidden[qsl[i] + lo - start:qsl[i] + hi - start]
                targets = torch.tensor(state.prompt_token_ids[lo + 1:hi + 1], device=self.device)
                lp = compute_logprobs_for_targets(self.model.compute_logits(rows), targets, k)
                entries.extend(logprob_dicts(lp, [k] * (hi - lo)))
            result.prompt_logprobs[state.req_id] = entries
