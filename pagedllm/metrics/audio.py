"""Speech-to-text series, in the server's registry: the audio seconds transcribed or translated, the 30 s windows
that became engine requests, finished requests and their latency (upload decoded to transcript). vLLM has no audio
series; each window also counts in the usual ``vllm:`` ones (tokens, e2e latency per engine request)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pagedllm.metrics.prometheus import _REQUEST_BUCKETS


class AudioMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "task"]
        self.model_name = model_name
        self._seconds = Counter("pagedllm:audio_seconds_processed", "Seconds of audio transcribed or translated.",
                                labels, registry=registry)
        self._windows = Counter("pagedllm:audio_windows", "30-second audio windows sent to the engine "
                                "(one engine request each).", labels, registry=registry)
        self._requests = Counter("pagedllm:audio_requests", "Finished transcription and translation requests.",
                                 labels, registry=registry)
        self._latency = Histogram("pagedllm:audio_request_latency_seconds",
                                  "Seconds from the decoded upload to the finished transcript.", labels,
                                  buckets=_REQUEST_BUCKETS, registry=registry)
        for task in ("transcribe", "translate"):  # show zeros before the first request
            for family in (self._seconds, self._windows, self._requests, self._latency):
                family.labels(model_name, task)

    def record(self, task: str, seconds: float, windows: int, latency_s: float) -> None:
        self._latency.labels(self.model_name, task).observe(latency_s)
        self._seconds.labels(self.model_name, task).inc(seconds)
        self._windows.labels(self.model_name, task).inc(windows)
        self._requests.labels(self.model_name, task).inc()
