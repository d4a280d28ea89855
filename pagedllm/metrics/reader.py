"""The engine's counters as plain values for offline users: ``LLM.get_metrics()`` (vLLM's reader shapes).

The same names as on /metrics, read straight from the engine cores' cumulative stats
(``core/scheduler_stats.py``) instead of through Prometheus: ``Counter`` and ``Gauge`` hold one value, ``Vector``
one value per position (the accepted draft tokens by position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.scheduler_stats import SchedulerStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


def engine_metrics(stats: list[SchedulerStats]) -> list[Metric]:
    """Each engine core's counters, labelled with its ``engine`` index."""
    metrics: list[Metric] = []
    for s in stats:
        labels = {"engine": str(s.engine_index)}
        metrics += [
            Gauge("vllm:num_requests_running", labels, s.num_running),
            Gauge("vllm:num_requests_waiting", labels, s.num_waiting),
            Gauge("vllm:kv_cache_usage_perc", labels, s.kv_cache_usage),
            Counter("vllm:num_preemptions", labels, s.num_preemptions),
            Counter("vllm:prefix_cache_queries", labels, s.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", labels, s.prefix_cache_hits),
            Counter("vllm:spec_decode_num_drafts", labels, s.spec_num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", labels, s.spec_num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", labels, s.spec_num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, list(s.spec_accepted_per_pos)),
        ]
        for key, count in sorted(s.spec_governor_decisions.items()):
            bucket, decision = key.split(":")
            metrics.append(Counter("pagedllm:spec_decode_governor_decisions",
                                   {**labels, "batch_size": bucket, "decision": decision}, count))
    return metrics
