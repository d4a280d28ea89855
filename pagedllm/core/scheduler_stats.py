"""What an engine core reports with every step: the counters the metrics room and the router read.

Built on the engine's side of the boundary (thread or process) from the scheduler; the API side never reads the
scheduler itself. Counters are cumulative (the reader exports differences); gauges are the step's values.
"""

from __future__ import annotations

from typing import Any

import msgspec


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    sliding_kv_cache_usage: float | None = None  # a hybrid model's sliding-window group; None with one group
    num_steps: int = 0  # cumulative model steps
    step_tokens: int = 0  # tokens computed by the last model step
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    # Speculative decoding, cumulative (core/spec_decode_stats.py); empty without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    spec_governor_decisions: dict[str, int] = {}  # "<batch-size bucket>:<on|off>" -> times
    # Cumulative prompt tokens by where their KV came from (core/remote_kv.PROMPT_TOKEN_SOURCES), and KV
    # transfers that failed (their prompts were recomputed).
    prompt_tokens_by_source: dict[str, int] = {}
    num_kv_transfer_failures: int = 0
    # request id -> (time.time() it was first scheduled, seconds it had queued), for the requests first scheduled
    # since the last report.
    first_scheduled: dict[str, tuple[float, float]] = {}
    # LoRA (0 slots: off): the adapter names of the running and the waiting requests (vllm:lora_requests_info).
    max_loras: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []

    @property
    def load(self) -> int:
        """What the data-parallel balancer compares: requests the engine holds."""
        return self.num_running + self.num_waiting


def make_scheduler_stats(core: Any, engine_index: int = 0,
                         newly_scheduled: dict[str, tuple[float, float]] | None = None) -> SchedulerStats:
    """``core`` is an ``EngineCore`` (duck-typed: ``scheduler``, ``num_steps``, ``last_step_tokens``)."""
    sched = core.scheduler
    kv = sched.kv
    spec = getattr(sched, "spec_stats", None)
    max_loras = getattr(getattr(sched, "config", None), "max_loras", 0)
    return SchedulerStats(
        engine_index=engine_index, num_running=sched.num_running, num_waiting=sched.num_waiting,
        kv_cache_usage=kv.usage, sliding_kv_cache_usage=kv.sliding_group_usage, num_steps=core.num_steps,
        step_tokens=core.last_step_tokens, num_preemptions=sched.num_preemptions,
        prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        spec_num_drafts=spec.num_drafts if spec is not None else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        spec_accepted_per_pos=list(spec.accepted_per_pos) if spec is not None else [],
        spec_governor_decisions=dict(spec.governor_decisions) if spec is not None else {},
        first_scheduled=newly_scheduled or {},
        prompt_tokens_by_source=dict(getattr(sched, "prompt_tokens_by_source", {})),
        num_kv_transfer_failures=sched.remote_kv.num_failed_transfers if getattr(sched, "remote_kv", None) else 0,
        max_loras=max_loras,
        running_lora_adapters=_adapter_names(sched.running) if max_loras else [],
        waiting_lora_adapters=_adapter_names(sched.waiting) if max_loras else [])


def _adapter_names(requests: Any) -> list[str]:
    """The distinct adapter names of ``requests``, sorted."""
    return sorted({r.lora.name for r in requests if getattr(r, "lora", None) is not None})
