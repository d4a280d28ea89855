"""Prometheus metrics with vLLM's names, so dashboards built for vLLM work unchanged.

Every metric carries a ``model_name`` label; the series an engine core reports (queue lengths, KV cache usage,
preemptions, prefix-cache counters, step sizes, speculative decoding) also an ``engine`` label, its data-parallel
index ("0" with one engine), as vLLM labels them. Each server owns its own ``CollectorRegistry`` (tests start
several in one process). Counters are exposed with the ``_total`` suffix by ``prometheus_client``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# vLLM's finish reasons; "abort" counts requests the client or a shutdown ended, "error" failed model steps.
FINISHED_REASONS = ("stop", "length", "abort", "error")


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's shape)."""
    buckets, exp = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exp += 1


class PrometheusMetrics:
    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self._request_success = Counter("vllm:request_success", "Successfully processed requests.",
                                        ["model_name", "finished_reason"], registry=r)
        for reason in FINISHED_REASONS:
            self._request_success.labels(model_name, reason)  # show zeros before the first request
        token_buckets = _token_buckets(max_model_len)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time to first token in seconds.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Inter-token latency in seconds.", _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "End-to-end request latency in seconds.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Time spent waiting in the queue, in seconds.", _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generation tokens per finished request.", token_buckets)

        # Where a finished request spent its time (vLLM's names): scheduled -> first token -> finished.
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Time spent in the prefill phase (first scheduled to first token).",
                                              _REQUEST_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "Time spent in the decode phase (first token to finished).",
                                             _REQUEST_BUCKETS)
        self.request_inference_time = histogram("vllm:request_inference_time_seconds",
                                                "Time spent running (first scheduled to finished).",
                                                _REQUEST_BUCKETS)
        self.request_time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                                       "Mean time per output token after the first, per request.",
                                                       _LATENCY_BUCKETS)
        # vLLM's: one series, its labels the adapters in use, its value the time they were reported.
        self._lora_requests_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                         ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._engine_families = _EngineFamilies(r, max_num_batched_tokens)
        self._engines: dict[int, EngineSeries] = {}
        self.engine(0)  # show engine 0's series before its first step

    def engine(self, index: int) -> EngineSeries:
        """The series one engine core reports (label ``engine``: its data-parallel index)."""
        series = self._engines.get(index)
        if series is None:
            series = self._engines[index] = EngineSeries(self._engine_families, self.model_name, str(index))
        return series

    def lora_requests(self, max_loras: int, running: list[str], waiting: list[str], now: float) -> None:
        """The adapters of the running and the waiting requests now (comma-separated names)."""
        self._lora_requests_info.clear()
        self._lora_requests_info.labels(str(max_loras), ",".join(waiting), ",".join(running)).set(now)

    def request_success(self, finished_reason: str) -> None:
        self._request_success.labels(self.model_name, finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineFamilies:
    """The metric families whose series carry an ``engine`` label (vLLM's label for a data-parallel rank)."""

    def __init__(self, r: CollectorRegistry, max_num_batched_tokens: int) -> None:
        labels = ["model_name", "engine"]
        self.num_requests_running = Gauge("vllm:num_requests_running", "Requests in model execution batches.",
                                          labels, registry=r)
        self.num_requests_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.",
                                          labels, registry=r)
        self.kv_cache_usage_perc = Gauge("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.",
                                         labels, registry=r)
        self.kv_cache_sliding_usage_perc = Gauge(
            "pagedllm:kv_cache_sliding_window_usage_perc",
            "Usage of a hybrid model's sliding-window KV cache group (Gemma 3's local layers; "
            "vllm:kv_cache_usage_perc is then the full-attention layers'); 0 for models with one group.",
            labels, registry=r)
        self.num_preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", labels,
                                       registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.",
                                            labels, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.",
                                         labels, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step.", labels,
                                          buckets=_token_buckets(max(max_num_batched_tokens, 1)), registry=r)
        # Speculative decoding (zero when it is off), vLLM's names.
        self.spec_decode_num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Draft runs verified (one per request per step that had drafts).",
            labels, registry=r)
        self.spec_decode_num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                                    labels, registry=r)
        self.spec_decode_num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.", labels, registry=r)
        self.spec_decode_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            [*labels, "position"], registry=r)
        self.spec_decode_governor_decisions = Counter(
            "pagedllm:spec_decode_governor_decisions",
            "The draft governor's decisions: drafting turned off where it measured slower than not drafting, and "
            "on again for a retry, by batch-size bucket (1, 2, 4, 8, ...).",
            [*labels, "batch_size", "decision"], registry=r)
        # Disaggregated prefill / decode: where prompt tokens' KV came from (vLLM's), failed transfers (ours).
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from: local_compute, "
            "local_cache_hit, external_kv_transfer (a KV connector).", [*labels, "source"], registry=r)
        self.kv_transfer_failures = Counter(
            "pagedllm:kv_transfer_failures", "KV transfers that failed; their prompts were recomputed locally.",
            labels, registry=r)


class EngineSeries:
    """One engine's children of the ``_EngineFamilies``."""

    def __init__(self, families: _EngineFamilies, model_name: str, engine: str) -> None:
        self._families = families
        self._labels = (model_name, engine)
        self.num_requests_running = families.num_requests_running.labels(model_name, engine)
        self.num_requests_waiting = families.num_requests_waiting.labels(model_name, engine)
        self.kv_cache_usage_perc = families.kv_cache_usage_perc.labels(model_name, engine)
        self.kv_cache_sliding_usage_perc = families.kv_cache_sliding_usage_perc.labels(model_name, engine)
        self.num_preemptions = families.num_preemptions.labels(model_name, engine)
        self.prefix_cache_queries = families.prefix_cache_queries.labels(model_name, engine)
        self.prefix_cache_hits = families.prefix_cache_hits.labels(model_name, engine)
        self.iteration_tokens = families.iteration_tokens.labels(model_name, engine)
        self.spec_decode_num_drafts = families.spec_decode_num_drafts.labels(model_name, engine)
        self.spec_decode_num_draft_tokens = families.spec_decode_num_draft_tokens.labels(model_name, engine)
        self.spec_decode_num_accepted_tokens = families.spec_decode_num_accepted_tokens.labels(model_name, engine)
        self.kv_transfer_failures = families.kv_transfer_failures.labels(model_name, engine)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            families.prompt_tokens_by_source.labels(model_name, engine, source)  # shown from the start

    def prompt_tokens_from(self, source: str, count: int) -> None:
        self._families.prompt_tokens_by_source.labels(*self._labels, source).inc(count)

    def spec_decode_governor_decided(self, bucket: str, decision: str, count: int) -> None:
        self._families.spec_decode_governor_decisions.labels(*self._labels, bucket, decision).inc(count)

    def spec_decode_accepted_at(self, position: int, count: int) -> None:
        self._families.spec_decode_accepted_per_pos.labels(*self._labels, str(position)).inc(count)
