"""Continuous batching: every step, running requests first, then waiting ones, under one token budget.

There is no prefill or decode phase. Each request's ``num_computed_tokens`` catches up with its
``num_tokens``; a long prompt simply takes several steps (chunked prefill), a prefix hit starts it further
along, and a preempted request starts again from zero (recompute).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.encoder_cache import EncoderCacheManager
from pagedllm.core.encoder_decoder import encoder_cost
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.multimodal import check_images_fit, end_outside_runs
from pagedllm.core.remote_kv import PROMPT_TOKEN_SOURCES, RemoteKVState, count_prompt_sources
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.logger import init_logger
from pagedllm.utils import cdiv

logger = init_logger(__name__)

# A request in this many failed steps is failed itself, even if it never failed alone (the fault then
# depends on the batch, not on one request, and isolating again would loop).
MAX_FAILED_STEPS = 3


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 enable_kv_cache_events: bool = False) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        # enable_kv_cache_events: the KV cache manager records events for a publisher (kv.take_events).
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, cache_config.prefix_caching_hash_seed,
                                 sliding_window=cache_config.sliding_window,
                                 sliding_group=cache_config.sliding_group(),
                                 hash_algo=cache_config.prefix_caching_hash_algo,
                                 enable_kv_cache_events=enable_kv_cache_events,
                                 cross_group=cache_config.cross_group())
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._known_to_runner: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []  # requests finished inside schedule()
        self._isolate: set[str] = set()  # requests from a failed step, to be run one per step
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        # A KV connector's scheduler half (attach_kv_connector; disaggregated prefill / decode), else None.
        self.remote_kv: RemoteKVState | None = None
        # Prompt tokens at first admission by where their KV came from (vllm:prompt_tokens_by_source).
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        # Multimodal prompts: the images whose encoder outputs the runner holds (core/encoder_cache.py).
        self.encoder_cache = EncoderCacheManager(scheduler_config.encoder_cache_capacity)

    def attach_kv_connector(self, connector) -> None:
        """Ask ``connector`` (a ``KVConnectorBase_V1``, scheduler role) for prompt KV and about finished requests."""
        self.remote_kv = RemoteKVState(connector, self.kv)

    # ---- admission ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it could never run (the engine checks this first)."""
        self.check_fits(request.num_prompt_tokens, pooling=request.pooling_params is not None)
        check_images_fit(request.mm_features, self.config.max_num_batched_tokens, self.encoder_cache.capacity)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, num_prompt_tokens: int, pooling: bool = False) -> None:
        check_prompt_fits(self.config, self.kv.num_usable_blocks, self.kv.block_size, num_prompt_tokens, pooling)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, or a stop string seen by the detokenizer)."""
        done = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    def _free(self, request: Request) -> dict | None:
        """Release a finished request (its blocks, unless a KV connector holds them for a transfer); returns the
        connector's ``kv_transfer_params`` for the client, if any."""
        self._isolate.discard(request.request_id)
        self._release_images(request, everything=True)
        params = None
        hold = False
        if self.remote_kv is not None:
            hold, params = self.remote_kv.on_finished(request)
        if not hold:
            self.kv.free(request)
        self._finished_since_last_step.add(request.request_id)
        self._known_to_runner.discard(request.request_id)
        del self.requests[request.request_id]
        return params

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        encoder_budget = self.config.max_num_batched_tokens  # image tokens the vision encoder may run this step
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        now = time.time()
        # After a failed step, its requests run alone, one per step, until each has run once.
        isolated = self._next_isolated()

        # Running requests first, oldest admission first.
        i = 0
        while isolated is None and i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids), budget)
            if num_new <= 0:
                i += 1
                continue
            # Images whose tokens fall in this chunk must be encoded (or cached) first: stop before one that can't.
            num_new, to_encode = self._plan_images(request, request.num_computed_tokens, num_new, encoder_budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = self._allocate(request, num_new)
                if new_blocks is not None:
                    break
                num_real = min(request.num_tokens - request.num_computed_tokens, budget)
                if 0 < num_real < num_new:
                    # Drafts are optional: verify none this step rather than preempt or cap anyone for them.
                    num_new = num_real
                    request.spec_token_ids = []
                    continue
                if i == 0 and len(self.running) == 1:
                    # Alone and still out of blocks: the whole cache is too small for it to grow.
                    self.running.pop()
                    self._cap_length(request)
                    break
                victim = self.running.pop()  # the most recently admitted request
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            encoder_budget -= self._commit_images(request, request.num_computed_tokens, num_new, to_encode)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            # Drafts that fit the budget are verified this step; the runner proposes fresh ones after it.
            num_spec = num_new - (request.num_tokens - request.num_computed_tokens)
            if num_spec > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
            if request.request_id in self._known_to_runner:
                cached_reqs.append(CachedRequestData(request.request_id,
                                                     tuple([b.block_id for b in g] for g in new_blocks),
                                                     request.num_computed_tokens))
            else:
                new_reqs.append(self._new_request_data(request))
            i += 1

        # Then waiting requests, unless we just had to preempt (memory is tight).
        grammar_pending: list[Request] = []  # still compiling their grammar: they keep their place
        adapters = self._running_adapters()  # LoRA: adapters of the running requests (None: LoRA off)
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR or (
                    request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self.remote_kv.ready(request)):
                grammar_pending.append(self.waiting.popleft())
                continue
            if adapters is not None and request.lora_key is not None and request.lora_key not in adapters \
                    and len(adapters) >= self.config.max_loras:
                # Every adapter slot is taken by running requests: it waits (keeping its place) until one frees.
                grammar_pending.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = ([], 0)
            num_external, load_async = 0, False
            # 0 unless its KV arrived from a connector (then it holds blocks for its whole prompt).
            start = request.num_computed_tokens
            # Pooling requests skip prefix hits: mean/CLS pooling needs every prompt position's state.
            if start == 0 and request.pooling_params is None:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                if self.remote_kv is not None:
                    num_external, load_async = self.remote_kv.matched_tokens(request, num_hit_tokens)
            if load_async:
                # Blocks for the whole prompt now; the request waits for its KV, others keep the step.
                blocks = self.kv.allocate_slots(request, num_external, hits, num_hit_tokens, cache=False)
                if blocks is None:
                    break
                request.num_computed_tokens = request.num_local_hit_tokens = num_hit_tokens
                self.remote_kv.connector.update_state_after_alloc(
                    request, self.kv.get_block_ids(request.request_id)[0], num_external)
                self.remote_kv.start_receiving(request, num_external)
                grammar_pending.append(self.waiting.popleft())
                continue
            num_new = request.num_tokens - start - num_hit_tokens - num_external
            # An encoder-decoder request's encoder runs in the step that admits it, and costs budget like tokens
            # (core/encoder_decoder.py); alone in a step it is admitted whatever the budget.
            encoder = encoder_cost(request, self.config)
            if encoder and encoder + 1 > budget and num_scheduled:
                break
            step_budget = max(budget - encoder, 1)
            no_chunking = not self.config.enable_chunked_prefill or self.config.is_encoder_only
            if no_chunking and num_new > step_budget:
                break
            num_new = min(num_new, step_budget)
            computed = start + num_hit_tokens + num_external
            planned, to_encode = self._plan_images(request, computed, num_new, encoder_budget)
            if planned <= 0 or (planned < num_new and no_chunking):
                break  # its next image cannot be encoded this step (budget or encoder cache): it waits
            num_new = planned
            if not self.config.is_encoder_only:  # an encoder keeps no KV cache
                new_blocks = self._allocate(request, num_new, hits, num_hit_tokens + num_external)
                if new_blocks is None:
                    break  # head of the queue waits for memory; later requests must not jump ahead of it
            self.waiting.popleft()
            if num_external:  # loaded by the connector at the start of this step
                request.num_local_hit_tokens = num_hit_tokens
                request.num_external_computed_tokens = num_external
                self.remote_kv.connector.update_state_after_alloc(
                    request, self.kv.get_block_ids(request.request_id)[0], num_external)
            request.num_computed_tokens = start + num_hit_tokens + num_external
            encoder_budget -= self._commit_images(request, request.num_computed_tokens, num_new, to_encode)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
                count_prompt_sources(self.prompt_tokens_by_source, request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if adapters is not None and request.lora_key is not None:
                adapters.add(request.lora_key)
            num_scheduled[request.request_id] = num_new
            budget -= num_new + encoder
            new_reqs.append(self._new_request_data(request))
            if isolated is not None:
                break
        self.waiting.extendleft(reversed(grammar_pending))
        if isolated is not None and isolated.request_id not in num_scheduled:
            # No room to run it alone while others hold the memory: go back to normal batching (if it
            # fails again there, MAX_FAILED_STEPS ends it).
            self._isolate.clear()

        for request in self.running:
            if request.request_id in num_scheduled:
                request.num_computed_tokens += num_scheduled[request.request_id]
                self._known_to_runner.add(request.request_id)
                self._release_images(request)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_since_last_step,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec_tokens,
            free_encoder_hashes=self.encoder_cache.take_freed(),
        )
        if self.remote_kv is not None:
            out.kv_connector_metadata = self.remote_kv.connector.build_connector_meta(out)
        self._finished_since_last_step = set()
        return out

    def _allocate(self, request: Request, num_new: int, hits: list | None = None, num_hit_tokens: int = 0):
        """allocate_slots with the drafter's lookahead slots if they fit, else without (the drafter then
        proposes only what the request's blocks can hold)."""
        lookahead = self.config.num_lookahead_tokens
        if lookahead:
            blocks = self.kv.allocate_slots(request, num_new, hits, num_hit_tokens, lookahead)
            if blocks is not None:
                return blocks
        return self.kv.allocate_slots(request, num_new, hits, num_hit_tokens)

    def _plan_images(self, request: Request, start: int, num_new: int, encoder_budget: int) -> tuple[int, list[int]]:
        """(tokens of ``[start, start + num_new)`` it may compute now, indices of its images to encode first).

        An image with tokens in the chunk is either in the encoder cache already, or is encoded this step if the
        step's encoder budget and the cache have room; otherwise the chunk stops before that image. Where image
        tokens attend to each other both ways (``whole_image_runs``), a chunk also never ends inside an image's run.
        """
        if not request.mm_features:
            return num_new, []
        if self.config.whole_image_runs:
            num_new = end_outside_runs(request.mm_features, start, start + num_new) - start
        to_encode: list[int] = []
        rows, planned = 0, set()
        for index, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, start + num_new):
                continue
            if self.encoder_cache.has(feature.identifier) or feature.identifier in planned:
                continue
            cost = feature.num_embeds
            if rows + cost > encoder_budget or not self.encoder_cache.can_allocate(rows + cost):
                return feature.offset - start, to_encode
            rows += cost
            planned.add(feature.identifier)
            to_encode.append(index)
        return num_new, to_encode

    def _commit_images(self, request: Request, start: int, num_new: int, to_encode: list[int]) -> int:
        """Record the scheduled chunk's images in the encoder cache; returns the image tokens encoded this step."""
        rows = 0
        for index, feature in enumerate(request.mm_features):
            if not feature.overlaps(start, start + num_new):
                continue
            if index in to_encode and not self.encoder_cache.has(feature.identifier):
                self.encoder_cache.allocate(feature.identifier, feature.num_embeds, request.request_id)
                rows += feature.num_embeds
            else:
                self.encoder_cache.use(feature.identifier, request.request_id)
        return rows

    def _release_images(self, request: Request, everything: bool = False) -> None:
        """The request no longer needs the encoder outputs of images it has computed past (all, ``everything``)."""
        for feature in request.mm_features:
            if everything or feature.end <= request.num_computed_tokens:
                self.encoder_cache.release(feature.identifier, request.request_id)
    def _running_adapters(self) -> set[str] | None:
        """The LoRA adapters (content digests) of the running requests; None when LoRA is off. The worker has
        ``max_loras`` slots, so the running requests never use more distinct adapters than that."""
        if not self.config.max_loras:
            return None
        return {r.lora_key for r in self.running if r.lora_key is not None}

    def _next_isolated(self) -> Request | None:
        """Move the first request awaiting isolation to the head of the queue and return it."""
        if not self._isolate:
            return None
        for request in self.waiting:
            if request.request_id in self._isolate:
                self.waiting.remove(request)
                self.waiting.appendleft(request)
                return request
        self._isolate.clear()  # all of them were aborted or finished meanwhile
        return None

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
            encoder_input=request.encoder_input,
            mm_features=request.mm_features,
            lora=request.lora,
        )

    def _cap_length(self, request: Request) -> None:
        logger.warning("request %s filled the whole KV cache (%d tokens); finishing it as 'length'",
                       request.request_id, request.num_tokens)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self._pending_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="length",
                                                      num_cached_tokens=max(request.num_cached_tokens, 0)))
        self._free(request)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the queue (recompute)."""
        self.kv.free(request)
        self._release_images(request, everything=True)
        self._known_to_runner.discard(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, free finished requests."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.remote_kv is not None:
            self.remote_kv.update(result.kv_connector_output)
        if result.spec_governor_decisions:
            self.spec_stats.governor_decisions = dict(result.spec_governor_decisions)
        for req_id in sched.num_scheduled_tokens:
            self._isolate.discard(req_id)  # it ran without failing
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            if request.pooling_params is not None:
                self._finish_pooled(request, result, outputs)
                continue
            prompt_lps = result.prompt_logprobs.get(req_id)
            tokens = result.sampled_token_ids.get(req_id)
            if not tokens:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(req_id, [], prompt_logprobs=prompt_lps))
                continue  # a partial prefill chunk samples nothing
            drafts = sched.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # Rejected drafts' K/V is stale: those positions are computed again from the real tokens.
                num_accepted = len(tokens) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.observe(len(drafts), num_accepted)
            new_tokens, finished = self._append_tokens(request, tokens)
            if not finished:
                request.spec_token_ids = self._clip_drafts(request, result.spec_token_ids.get(req_id))
            new_logprobs = result.logprobs.get(req_id)
            outputs.append(EngineCoreOutput(
                req_id, new_tokens,
                finish_reason=request.status.finish_reason if finished else None,
                stop_reason=request.stop_reason,
                new_logprobs=new_logprobs[:len(new_tokens)] if new_logprobs else new_logprobs,
                prompt_logprobs=prompt_lps,
                num_cached_tokens=max(request.num_cached_tokens, 0)))
            if finished:
                self.running.remove(request)
                outputs[-1].kv_transfer_params = self._free(request)
        return outputs

    def _finish_pooled(self, request: Request, result: ModelRunnerOutput, outputs: list[EngineCoreOutput]) -> None:
        """A pooling request finishes (its KV blocks freed) in the step that computed its last prompt token."""
        pooled = result.pooler_output.get(request.request_id)
        if pooled is None:
            return  # a partial prefill chunk
        request.status = RequestStatus.FINISHED_STOPPED
        outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="stop", pooling_output=pooled,
                                        num_cached_tokens=max(request.num_cached_tokens, 0)))
        self.running.remove(request)
        self._free(request)

    def _append_tokens(self, request: Request, tokens: list[int]) -> tuple[list[int], bool]:
        """Append one step's tokens one by one, stopping at the first that ends the request."""
        for count, token in enumerate(tokens, 1):
            request.append_output_token(token)
            if request.check_stop(self.max_model_len):
                return tokens[:count], True
        return tokens, False

    def _clip_drafts(self, request: Request, drafts: list[int] | None) -> list[int]:
        """Drafts worth verifying: none past max_tokens, and none whose position would reach the last
        position of the context (the request ends there anyway)."""
        if not drafts:
            return []
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        return list(drafts[:max(room, 0)])

    def recover_from_failed_step(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """The step's forward pass raised. A request that ran alone in it is failed ("error"); the others
        go back to the queue to be recomputed one per step, so a request that breaks the model costs only
        itself. K/V written by the failed step is dropped from the prefix cache.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        in_step = [self.requests[r] for r in sched.num_scheduled_tokens
                   if r in self.requests and not self.requests[r].is_finished]
        for request in in_step:
            req_id = request.request_id
            request.num_failed_steps += 1
            self.kv.uncache_from(request, request.num_computed_tokens - sched.num_scheduled_tokens[req_id])
            self.running.remove(request)
            if len(sched.num_scheduled_tokens) == 1 or request.num_failed_steps >= MAX_FAILED_STEPS:
                logger.error("request %s failed: the model step raised with it in the batch", req_id)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="error",
                                                num_cached_tokens=max(request.num_cached_tokens, 0)))
                self._free(request)
            else:
                self._preempt(request)
                self._finished_since_last_step.add(req_id)  # the runner drops its copy of the state
                self._isolate.add(req_id)
        return outputs

    # ---- introspection -----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks a connector holds, or requests waiting for their KV: the engine must
        keep stepping (the worker half reports transfers only when asked)."""
        return self.remote_kv is not None and self.remote_kv.has_pending

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def check_prompt_fits(config: SchedulerConfig, num_usable_blocks: int, block_size: int, num_prompt_tokens: int,
                      pooling: bool = False) -> None:
    """ValueError naming the field if a prompt can never run: longer than the context, or than the KV cache.

    The one place admission limits are decided; the API side of an engine process calls it with the block
    count the engine reported at start-up.
    """
    if pooling:  # nothing is generated: the whole context may be prompt
        if num_prompt_tokens > config.max_model_len:
            raise ValueError(
                f"input: {num_prompt_tokens} tokens is too long; the model's maximum length is "
                f"{config.max_model_len} tokens (set truncate_prompt_tokens to cut the input)")
        if config.is_encoder_only:
            if num_prompt_tokens > config.max_num_batched_tokens:
                raise ValueError(f"input: {num_prompt_tokens} tokens do not fit in one step of "
                                 f"{config.max_num_batched_tokens} tokens; raise --max-num-batched-tokens")
        elif cdiv(num_prompt_tokens, block_size) > num_usable_blocks:
            raise ValueError(f"input: {num_prompt_tokens} tokens can never fit in the KV cache; "
                             "raise --kv-cache-memory")
        return
    if num_prompt_tokens >= config.max_model_len:
        raise ValueError(
            f"prompt: {num_prompt_tokens} tokens is too long; the maximum context length is "
            f"{config.max_model_len} tokens and at least one token must be generated")
    if cdiv(num_prompt_tokens + 1, block_size) > num_usable_blocks:
        raise ValueError(
            f"prompt: {num_prompt_tokens} tokens can never fit in the KV cache "
            f"({num_usable_blocks} blocks of {block_size} tokens); raise --kv-cache-memory")
