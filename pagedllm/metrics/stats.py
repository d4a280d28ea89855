"""Engine statistics → Prometheus metrics and a periodic one-line log.

Runs on the engine thread (``AsyncLLM`` calls ``record_step`` after each step), so it reads scheduler
state without locks; Prometheus objects are thread-safe for the ``/metrics`` reader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.output_processor import OutputKind
from pagedllm.engine.processor import child_request_id
from pagedllm.logger import init_logger
from pagedllm.metrics.prometheus import FINISHED_REASONS, PrometheusMetrics
from pagedllm.outputs import RequestOutput

logger = init_logger("pagedllm.metrics")

LOG_INTERVAL_S = 10.0


@dataclass
class _Tracked:
    kind: OutputKind
    first_child_id: str
    num_generation_tokens: int = 0
    last_token_time: float | None = None
    queue_time_recorded: bool = False
    first_scheduled_time: float | None = None


class StatsRecorder:
    def __init__(self, metrics: PrometheusMetrics | None, log_stats: bool = True,
                 log_interval_s: float = LOG_INTERVAL_S) -> None:
        self.metrics = metrics
        self.log_stats = log_stats
        self.log_interval_s = log_interval_s
        self._tracked: dict[str, _Tracked] = {}
        self._unscheduled: set[str] = set()
        # Engine counters are cumulative; remember what we already exported.
        self._seen_preemptions = 0
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_steps = 0
        # Since the last log line.
        self._last_log = time.time()
        self._interval_prompt_tokens = 0
        self._interval_gen_tokens = 0
        self._interval_queries = 0
        self._interval_hits = 0
        # Speculative decoding: cumulative counters already exported, and the interval's drafts.
        self._seen_spec = (0, 0, 0, [])
        self._interval_drafts = 0
        self._interval_accepted = 0

    def add_request(self, request_id: str, kind: OutputKind, n: int) -> None:
        """Engine thread, right after the engine accepted the request."""
        self._tracked[request_id] = _Tracked(kind, child_request_id(request_id, 0, n))
        self._unscheduled.add(request_id)

    def record_step(self, engine: Any, outputs: list[RequestOutput], now: float) -> None:
        sched = engine.core.scheduler
        m = self.metrics
        step_tokens = 0
        if engine.core.num_steps != self._seen_steps:
            self._seen_steps = engine.core.num_steps
            step_tokens = engine.core.last_step_tokens
            if m is not None:
                m.iteration_tokens.observe(step_tokens)
        self._record_queue_times(sched)
        gen_this_step = 0
        for out in outputs:
            gen_this_step += self._record_output(out, now)
        # Tokens computed for prompts this step ≈ step tokens minus the ones that sampled a new token.
        self._interval_prompt_tokens += max(step_tokens - gen_this_step, 0)
        self._interval_gen_tokens += gen_this_step

        kv = sched.kv
        d_pre, self._seen_preemptions = sched.num_preemptions - self._seen_preemptions, sched.num_preemptions
        d_q, self._seen_queries = kv.prefix_cache_queries - self._seen_queries, kv.prefix_cache_queries
        d_h, self._seen_hits = kv.prefix_cache_hits - self._seen_hits, kv.prefix_cache_hits
        self._interval_queries += d_q
        self._interval_hits += d_h
        self._record_spec_decode(sched)
        if m is not None:
            m.num_requests_running.set(sched.num_running)
            m.num_requests_waiting.set(sched.num_waiting)
            m.kv_cache_usage_perc.set(kv.usage)
            m.kv_cache_sliding_usage_perc.set(kv.sliding_group_usage or 0.0)
            if d_pre > 0:
                m.num_preemptions.inc(d_pre)
            if d_q > 0:
                m.prefix_cache_queries.inc(d_q)
            if d_h > 0:
                m.prefix_cache_hits.inc(d_h)

    def _record_spec_decode(self, sched: Any) -> None:
        stats = getattr(sched, "spec_stats", None)
        if stats is None or stats.num_drafts == self._seen_spec[0]:
            return
        drafts, draft_tokens, accepted, per_pos = self._seen_spec
        d_drafts, d_accepted = stats.num_drafts - drafts, stats.num_accepted_tokens - accepted
        self._interval_drafts += d_drafts
        self._interval_accepted += d_accepted
        m = self.metrics
        if m is not None:
            m.spec_decode_num_drafts.inc(d_drafts)
            m.spec_decode_num_draft_tokens.inc(stats.num_draft_tokens - draft_tokens)
            m.spec_decode_num_accepted_tokens.inc(d_accepted)
            for pos, count in enumerate(stats.accepted_per_pos):
                seen = per_pos[pos] if pos < len(per_pos) else 0
                if count > seen:
                    m.spec_decode_accepted_at(pos, count - seen)
        self._seen_spec = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                           list(stats.accepted_per_pos))

    def _record_queue_times(self, sched: Any) -> None:
        if not self._unscheduled or self.metrics is None:
            self._unscheduled.clear()
            return
        for request_id in list(self._unscheduled):
            tracked = self._tracked.get(request_id)
            request = sched.requests.get(tracked.first_child_id) if tracked else None
            if request is None:
                self._unscheduled.discard(request_id)
            elif request.first_scheduled_time is not None:
                tracked.first_scheduled_time = request.first_scheduled_time
                queued = request.first_scheduled_time - request.arrival_time
                self.metrics.request_queue_time.observe(max(queued, 0.0))
                self._unscheduled.discard(request_id)

    def _record_output(self, out: RequestOutput, now: float) -> int:
        """Returns the generation tokens this output adds."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return 0
        m = self.metrics
        total = sum(len(c.token_ids) for c in out.outputs)
        new = total if tracked.kind == OutputKind.DELTA else total - tracked.num_generation_tokens
        if tracked.kind == OutputKind.DELTA:
            tracked.num_generation_tokens += total
        else:
            tracked.num_generation_tokens = total
        if new > 0 and m is not None:
            m.generation_tokens.inc(new)
            if tracked.last_token_time is None:
                m.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.metrics is not None and out.metrics.first_token_time is not None:
                    m.time_to_first_token.observe(out.metrics.first_token_time - out.metrics.arrival_time)
            elif tracked.kind != OutputKind.FINAL_ONLY:
                gap = (now - tracked.last_token_time) / new
                for _ in range(new):
                    m.inter_token_latency.observe(gap)
        if new > 0:
            tracked.last_token_time = now
        if out.finished:
            self._tracked.pop(out.request_id, None)
            self._unscheduled.discard(out.request_id)
            if m is not None:
                reason = out.outputs[0].finish_reason if out.outputs else None
                if reason in FINISHED_REASONS:
                    m.request_success(reason)
                if out.metrics is not None:
                    finished_time = out.metrics.finished_time or now
                    m.e2e_request_latency.observe(finished_time - out.metrics.arrival_time)
                    self._record_phase_times(tracked, out.metrics.first_token_time, finished_time)
                m.request_prompt_tokens.observe(len(out.prompt_token_ids))
                m.request_generation_tokens.observe(tracked.num_generation_tokens)
        return max(new, 0)

    def _record_phase_times(self, tracked: _Tracked, first_token_time: float | None, finished_time: float) -> None:
        """Prefill / decode / inference time and time per output token of a finished request."""
        m = self.metrics
        scheduled = tracked.first_scheduled_time
        if scheduled is not None:
            m.request_inference_time.observe(max(finished_time - scheduled, 0.0))
            if first_token_time is not None:
                m.request_prefill_time.observe(max(first_token_time - scheduled, 0.0))
        if first_token_time is not None:
            m.request_decode_time.observe(max(finished_time - first_token_time, 0.0))
            if tracked.num_generation_tokens > 1:
                m.request_time_per_output_token.observe(
                    max(finished_time - first_token_time, 0.0) / (tracked.num_generation_tokens - 1))

    def forget(self, request_id: str) -> None:
        """An aborted request produces no final output through the engine; drop its bookkeeping."""
        tracked = self._tracked.pop(request_id, None)
        self._unscheduled.discard(request_id)
        if tracked is not None and self.metrics is not None:
            self.metrics.request_success("abort")

    def maybe_log(self, engine: Any, now: float, force: bool = False) -> None:
        elapsed = now - self._last_log
        if not force and elapsed < self.log_interval_s:
            return
        sched = engine.core.scheduler
        active = (self._interval_prompt_tokens or self._interval_gen_tokens or sched.num_running
                  or sched.num_waiting)
        if self.metrics is not None:
            # Idle periods end with running/waiting/usage at their final values.
            self.metrics.num_requests_running.set(sched.num_running)
            self.metrics.num_requests_waiting.set(sched.num_waiting)
            self.metrics.kv_cache_usage_perc.set(sched.kv.usage)
            self.metrics.kv_cache_sliding_usage_perc.set(sched.kv.sliding_group_usage or 0.0)
        if active and self.log_stats and elapsed > 0:
            hit_rate = self._interval_hits / self._interval_queries if self._interval_queries else 0.0
            sliding = sched.kv.sliding_group_usage
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%%s, Prefix cache hit rate: "
                        "%.1f%%", self._interval_prompt_tokens / elapsed, self._interval_gen_tokens / elapsed,
                        sched.num_running, sched.num_waiting, sched.kv.usage * 100,
                        "" if sliding is None else f" (sliding-window layers: {sliding * 100:.1f}%)", hit_rate * 100)
            if self._interval_drafts:
                logger.info("Speculative decoding: mean acceptance length %.2f tokens per step (%d drafts, "
                            "%d draft tokens accepted)", 1 + self._interval_accepted / self._interval_drafts,
                            self._interval_drafts, self._interval_accepted)
        self._last_log = now
        self._interval_prompt_tokens = self._interval_gen_tokens = 0
        self._interval_queries = self._interval_hits = 0
        self._interval_drafts = self._interval_accepted = 0
