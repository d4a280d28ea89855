"""Per-request histograms from the outputs a client consumes: one inter-token gap per token after the first; an
idle server's gauges follow the engine's late reports."""

import time
from types import SimpleNamespace

from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.output_processor import OutputKind
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import StatsRecorder
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

NO_STATS = SimpleNamespace(take_stats=list)  # an engine with no scheduler reports this step


def _count(metrics: PrometheusMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def _delta(token_ids: list[int], finished: bool = False) -> RequestOutput:
    timing = RequestMetrics(arrival_time=100.0, first_token_time=100.5)
    choice = CompletionOutput(0, "", token_ids, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1, 2, 3], [choice], finished, metrics=timing)


def test_streamed_outputs_give_one_gap_per_later_token_even_when_merged() -> None:
    """Steps that ran while the consumer was busy arrive merged; the first output may already hold three tokens."""
    metrics = PrometheusMetrics("m", 512, 2048)
    recorder = StatsRecorder(metrics, log_stats=False)
    recorder.add_request("r", OutputKind.DELTA, 1)
    recorder.record_step(NO_STATS, [_delta([7, 8, 9])], 101.5)
    assert _count(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert _count(metrics, "vllm:inter_token_latency_seconds_count") == 2
    assert _count(metrics, "vllm:inter_token_latency_seconds_sum") == 1.0  # 1 s since the first token, 2 gaps
    recorder.record_step(NO_STATS, [_delta([10, 11], finished=True)], 102.0)
    assert _count(metrics, "vllm:inter_token_latency_seconds_count") == 4
    assert _count(metrics, "vllm:request_generation_tokens_sum") == 5


def test_a_final_only_output_has_no_gaps_to_observe() -> None:
    metrics = PrometheusMetrics("m", 512, 2048)
    recorder = StatsRecorder(metrics, log_stats=False)
    recorder.add_request("r", OutputKind.FINAL_ONLY, 1)
    recorder.record_step(NO_STATS, [_delta([7, 8, 9, 10, 11], finished=True)], 102.0)
    assert _count(metrics, "vllm:inter_token_latency_seconds_count") == 0
    assert _count(metrics, "vllm:generation_tokens_total") == 5


class _IdleRemoteEngine:
    """An engine in its own process that has nothing to run and reports late (as after an abort)."""

    builds_own_snapshots = True

    def __init__(self) -> None:
        self.reports: list[SchedulerStats] = []

    def set_wakeup(self, wake) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False

    def take_stats(self) -> list[SchedulerStats]:
        reports, self.reports = self.reports, []
        return reports

    def shutdown(self) -> None:
        pass


def test_an_idle_servers_gauges_take_a_late_report_within_a_wake() -> None:
    """The blocks an abort frees are reported by the engine process after the abort command ran: the idle loop
    reads that report on its next wake (about a second), not when the next log line is due (ten)."""
    metrics = PrometheusMetrics("m", 512, 2048)
    engine = _IdleRemoteEngine()
    llm = AsyncLLM(engine, StatsRecorder(metrics, log_stats=False))
    try:
        engine.reports.append(SchedulerStats(engine_index=0, kv_cache_usage=0.25))
        deadline = time.monotonic() + 5
        while _count(metrics, "vllm:kv_cache_usage_perc") != 0.25:
            assert time.monotonic() < deadline, "the idle loop never read the engine's late report"
            time.sleep(0.05)
    finally:
        llm.shutdown(5.0)
