"""Engine statistics → Prometheus metrics and a periodic one-line log.

Runs on ``AsyncLLM``'s output thread (``record_step`` after each step's outputs). The engine cores' state
arrives as ``SchedulerStats`` (``core/scheduler_stats.py``), one per engine per step, from the engine's side of
the boundary; this room never reads a scheduler. Prometheus objects are thread-safe for the ``/metrics`` reader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagedllm.core.scheduler_stats import SchedulerStats, make_scheduler_stats
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
        self._parent_of_first_child: dict[str, str] = {}  # whose queue time a child's first scheduling gives
        # Each engine's latest stats; its counters are cumulative, so the previous report gives the differences.
        self._engines: dict[int, SchedulerStats] = {}
        # Since the last log line.
        self._last_log = time.time()
        self._interval_prompt_tokens = 0
        self._interval_gen_tokens = 0
        self._interval_queries = 0
        self._interval_hits = 0
        # Speculative decoding: the interval's drafts.
        self._interval_drafts = 0
        self._interval_accepted = 0
        self._interval_draft_tokens = 0
        self._interval_per_pos: list[int] = []  # accepted drafts by position, this interval

    def add_request(self, request_id: str, kind: OutputKind, n: int) -> None:
        """Right after the engine accepted the request."""
        first_child = child_request_id(request_id, 0, n)
        self._tracked[request_id] = _Tracked(kind, first_child)
        self._parent_of_first_child[first_child] = request_id

    def record_step(self, engine: Any, outputs: list[RequestOutput], now: float) -> None:
        step_tokens = 0
        for stats in _take_stats(engine):
            step_tokens += self._record_engine_stats(stats)
        gen_this_step = 0
        for out in outputs:
            gen_this_step += self._record_output(out, now)
        # Tokens computed for prompts this step ≈ step tokens minus the ones that sampled a new token.
        self._interval_prompt_tokens += max(step_tokens - gen_this_step, 0)
        self._interval_gen_tokens += gen_this_step

    def _record_engine_stats(self, stats: SchedulerStats) -> int:
        """Export one engine's report; returns the tokens of its model steps since its previous report."""
        prev = self._engines.get(stats.engine_index) or SchedulerStats(engine_index=stats.engine_index)
        self._engines[stats.engine_index] = stats
        self._record_queue_times(stats)
        d_q = stats.prefix_cache_queries - prev.prefix_cache_queries
        d_h = stats.prefix_cache_hits - prev.prefix_cache_hits
        self._interval_queries += d_q
        self._interval_hits += d_h
        d_drafts = stats.spec_num_drafts - prev.spec_num_drafts
        d_accepted = stats.spec_num_accepted_tokens - prev.spec_num_accepted_tokens
        self._interval_drafts += d_drafts
        self._interval_accepted += d_accepted
        self._interval_draft_tokens += stats.spec_num_draft_tokens - prev.spec_num_draft_tokens
        for pos, count in enumerate(stats.spec_accepted_per_pos):
            seen = prev.spec_accepted_per_pos[pos] if pos < len(prev.spec_accepted_per_pos) else 0
            if pos >= len(self._interval_per_pos):
                self._interval_per_pos.append(0)
            self._interval_per_pos[pos] += count - seen
        stepped = stats.num_steps != prev.num_steps
        if self.metrics is not None:
            m = self.metrics.engine(stats.engine_index)
            if stepped:
                m.iteration_tokens.observe(stats.step_tokens)
            if stats.max_loras:
                self.metrics.lora_requests(stats.max_loras, stats.running_lora_adapters, stats.waiting_lora_adapters,
                                           time.time())
            m.num_requests_running.set(stats.num_running)
            m.num_requests_waiting.set(stats.num_waiting)
            m.kv_cache_usage_perc.set(stats.kv_cache_usage)
            m.kv_cache_sliding_usage_perc.set(stats.sliding_kv_cache_usage or 0.0)
            _inc(m.num_preemptions, stats.num_preemptions - prev.num_preemptions)
            for key, count in stats.spec_governor_decisions.items():
                seen = prev.spec_governor_decisions.get(key, 0)
                if count > seen:
                    bucket, decision = key.split(":")
                    m.spec_decode_governor_decided(bucket, decision, count - seen)
            _inc(m.prefix_cache_queries, d_q)
            _inc(m.prefix_cache_hits, d_h)
            for source, count in stats.prompt_tokens_by_source.items():
                seen = prev.prompt_tokens_by_source.get(source, 0)
                if count > seen:
                    m.prompt_tokens_from(source, count - seen)
            _inc(m.kv_transfer_failures, stats.num_kv_transfer_failures - prev.num_kv_transfer_failures)
            if d_drafts > 0:
                m.spec_decode_num_drafts.inc(d_drafts)
                _inc(m.spec_decode_num_draft_tokens, stats.spec_num_draft_tokens - prev.spec_num_draft_tokens)
                _inc(m.spec_decode_num_accepted_tokens, d_accepted)
                for pos, count in enumerate(stats.spec_accepted_per_pos):
                    seen = prev.spec_accepted_per_pos[pos] if pos < len(prev.spec_accepted_per_pos) else 0
                    if count > seen:
                        m.spec_decode_accepted_at(pos, count - seen)
        return stats.step_tokens if stepped else 0

    def _record_queue_times(self, stats: SchedulerStats) -> None:
        for child_id, (scheduled_at, queued_s) in stats.first_scheduled.items():
            parent = self._parent_of_first_child.pop(child_id, None)
            tracked = self._tracked.get(parent) if parent is not None else None
            if tracked is None or tracked.queue_time_recorded:
                continue
            tracked.first_scheduled_time = scheduled_at
            tracked.queue_time_recorded = True
            if self.metrics is not None:
                self.metrics.request_queue_time.observe(queued_s)

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
                first_token_time = out.metrics.first_token_time if out.metrics is not None else None
                if first_token_time is not None:
                    m.time_to_first_token.observe(first_token_time - out.metrics.arrival_time)
                # A streamed first output can carry more than each choice's first token (steps that ran
                # while the consumer was busy): the rest are inter-token gaps, spread since the first token.
                later = new - sum(1 for c in out.outputs if c.token_ids)
                if later > 0 and tracked.kind != OutputKind.FINAL_ONLY:
                    gap = max(now - first_token_time, 0.0) / later if first_token_time is not None else 0.0
                    for _ in range(later):
                        m.inter_token_latency.observe(gap)
            elif tracked.kind != OutputKind.FINAL_ONLY:
                gap = (now - tracked.last_token_time) / new
                for _ in range(new):
                    m.inter_token_latency.observe(gap)
        if new > 0:
            tracked.last_token_time = now
        if out.finished:
            self._tracked.pop(out.request_id, None)
            self._parent_of_first_child.pop(tracked.first_child_id, None)
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
        if tracked is not None:
            self._parent_of_first_child.pop(tracked.first_child_id, None)
        if tracked is not None and self.metrics is not None:
            self.metrics.request_success("abort")

    def maybe_log(self, engine: Any, now: float, force: bool = False) -> None:
        elapsed = now - self._last_log
        if not force and elapsed < self.log_interval_s:
            return
        for stats in _take_stats(engine):  # an idle engine's last word (e.g. blocks freed by an abort)
            self._record_engine_stats(stats)
        engines = list(self._engines.values())
        running = sum(e.num_running for e in engines)
        waiting = sum(e.num_waiting for e in engines)
        active = self._interval_prompt_tokens or self._interval_gen_tokens or running or waiting
        if active and self.log_stats and elapsed > 0:
            hit_rate = self._interval_hits / self._interval_queries if self._interval_queries else 0.0
            usage = sum(e.kv_cache_usage for e in engines) / max(len(engines), 1)
            sliding = [e.sliding_kv_cache_usage for e in engines if e.sliding_kv_cache_usage is not None]
            per_engine = "" if len(engines) < 2 else " (" + ", ".join(
                f"engine {e.engine_index}: {e.num_running} running, {e.num_waiting} waiting, "
                f"KV {e.kv_cache_usage * 100:.1f}%" for e in sorted(engines, key=lambda e: e.engine_index)) + ")"
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%%s, Prefix cache hit rate: "
                        "%.1f%%%s", self._interval_prompt_tokens / elapsed, self._interval_gen_tokens / elapsed,
                        running, waiting, usage * 100,
                        "" if not sliding else f" (sliding-window layers: {sum(sliding) / len(sliding) * 100:.1f}%)",
                        hit_rate * 100, per_engine)
            if self._interval_drafts:
                # vLLM's line: the acceptance rate of draft tokens and, per position, the share of drafts
                # whose token at that position was accepted.
                per_pos = ", ".join(f"{n / self._interval_drafts:.2f}" for n in self._interval_per_pos)
                logger.info("Speculative decoding: mean acceptance length %.2f tokens per step, accepted %d of %d "
                            "draft tokens (%.1f%%) in %d drafts, per-position acceptance rate: %s",
                            1 + self._interval_accepted / self._interval_drafts, self._interval_accepted,
                            self._interval_draft_tokens,
                            100 * self._interval_accepted / max(self._interval_draft_tokens, 1),
                            self._interval_drafts, per_pos)
        self._last_log = now
        self._interval_prompt_tokens = self._interval_gen_tokens = 0
        self._interval_queries = self._interval_hits = 0
        self._interval_drafts = self._interval_accepted = self._interval_draft_tokens = 0
        self._interval_per_pos = []


def _take_stats(engine: Any) -> list[SchedulerStats]:
    """The engine cores' reports since the last call (``LLMEngine`` / ``MultiprocEngine.take_stats``); an engine
    object without that method is read directly (tests' stand-ins)."""
    take = getattr(engine, "take_stats", None)
    return take() if take is not None else [make_scheduler_stats(engine.core)]


def _inc(counter: Any, amount: int) -> None:
    if amount > 0:
        counter.inc(amount)
