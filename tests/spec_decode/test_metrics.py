"""Speculative-decoding counters reach Prometheus with vLLM's names and the periodic log line."""

import logging
import time
from types import SimpleNamespace

from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.metrics.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import StatsRecorder


def _engine(stats: SpecDecodingStats) -> SimpleNamespace:
    kv = SimpleNamespace(prefix_cache_queries=0, prefix_cache_hits=0, usage=0.0, sliding_group_usage=None)
    sched = SimpleNamespace(spec_stats=stats, kv=kv, num_preemptions=0, num_running=1, num_waiting=0,
                            requests={})
    return SimpleNamespace(core=SimpleNamespace(scheduler=sched, num_steps=0, last_step_tokens=0))


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_counters_and_mean_acceptance_length(caplog) -> None:
    metrics = PrometheusMetrics("m", 512, 2048)
    stats = SpecDecodingStats()
    engine = _engine(stats)
    recorder = StatsRecorder(metrics, log_stats=True, log_interval_s=0.0)
    stats.observe(4, 4)
    stats.observe(4, 1)
    recorder.record_step(engine, [], 0.0)
    stats.observe(3, 2)
    recorder.record_step(engine, [], 0.0)
    text = metrics.render().decode()
    assert _value(text, "vllm:spec_decode_num_drafts_total") == 3
    assert _value(text, "vllm:spec_decode_num_draft_tokens_total") == 11
    assert _value(text, "vllm:spec_decode_num_accepted_tokens_total") == 7
    per_pos = {line.split('position="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert per_pos == {"0": 3, "1": 2, "2": 1, "3": 1}
    assert "pagedllm:spec_decode_governor_decisions_total{" not in text
    # The draft governor turned drafting off twice at batch size ~1 and once at ~8, and on again once at ~1.
    stats.governor_decisions = {"1:off": 2, "1:on": 1, "8:off": 1}
    recorder.record_step(engine, [], 0.0)
    stats.governor_decisions = {"1:off": 3, "1:on": 1, "8:off": 1}
    recorder.record_step(engine, [], 0.0)
    text = metrics.render().decode()
    decisions = {(line.split('batch_size="')[1].split('"')[0], line.split('decision="')[1].split('"')[0]):
                 float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("pagedllm:spec_decode_governor_decisions_total{")}
    assert decisions == {("1", "off"): 3, ("1", "on"): 1, ("8", "off"): 1}
    assert stats.num_auto_disabled == 4
    logger = logging.getLogger("pagedllm.metrics")
    logger.addHandler(caplog.handler)  # the package logger does not propagate to the root
    try:
        recorder.maybe_log(engine, time.time() + 1.0, force=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert "mean acceptance length 3.33" in caplog.text  # 1 + 7 / 3
    assert "accepted 7 of 11 draft tokens" in caplog.text
    assert "per-position acceptance rate: 1.00, 0.67, 0.33, 0.33" in caplog.text
    assert stats.mean_acceptance_length == 1 + 7 / 3
