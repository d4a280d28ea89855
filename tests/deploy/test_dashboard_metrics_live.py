"""Against a running ``pagedllm serve``: every metric the dashboard queries is exported, and the metrics added
for the dashboard (request phase times, finish reasons) move as requests run."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_grafana_dashboard import SPEC_DECODE_METRICS, dashboard_metric_names

from helpers.deploy_checks import REPO_ROOT, load_dashboard

pytestmark = pytest.mark.slow


def _remote_server_cls():
    # The suite's way of starting a real server (tests/entrypoints/conftest.py), loaded under its own name.
    spec = importlib.util.spec_from_file_location("entrypoints_server", REPO_ROOT / "tests/entrypoints/conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RemoteServer


@pytest.fixture(scope="module")
def server() -> Iterator:
    srv = _remote_server_cls()(["--served-model-name", "dash-model"])
    try:
        yield srv
    finally:
        srv.stop()


def scrape(server) -> dict[str, float]:
    """Sample name (with labels) -> value, plus each bare sample name -> summed value."""
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            out[f"{sample.name}{{{labels}}}"] = sample.value
            if "le" not in sample.labels:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_dashboard_queries_only_exported_metrics(server):
    exported = {name.split("{")[0] for name in scrape(server)}
    missing = {name: titles for name, titles in dashboard_metric_names(load_dashboard()).items()
               if name not in exported}
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    # Speculative decoding's counters are exported (at zero) even when it is off, so its panels always resolve.
    assert SPEC_DECODE_METRICS <= exported


def test_request_phase_metrics_and_finish_reasons(server):
    client = server.client()
    before = scrape(server)
    client.chat.completions.create(model="dash-model", messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    after = scrape(server)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for hist in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds"):
        assert moved(f"{hist}_count") == 1, hist
        # Each phase of the request took time: 6 tokens, the first from a prefill, 5 from decode steps.
        assert moved(f"{hist}_sum") > 0, hist
    # Prefill + decode make up the inference time of the one request.
    parts = moved("vllm:request_prefill_time_seconds_sum") + moved("vllm:request_decode_time_seconds_sum")
    assert parts == pytest.approx(moved("vllm:request_inference_time_seconds_sum"), abs=1e-6)
    assert moved("vllm:request_success_total{finished_reason=length,model_name=dash-model}") == 1
    for reason in ("stop", "length", "abort", "error"):
        assert f"vllm:request_success_total{{finished_reason={reason},model_name=dash-model}}" in after


def test_aborted_requests_are_counted(server):
    key = "vllm:request_success_total{finished_reason=abort,model_name=dash-model}"
    before = scrape(server)[key]
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{server.url}/v1/completions",
            json={"model": "dash-model", "prompt": "Count to a thousand:", "max_tokens": 1000,
                  "ignore_eos": True, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert any(line.startswith("data: ") for line in (next(lines) for _ in range(4)))
    # The client went away mid-stream; the server aborts the request and counts it once.
    deadline = time.monotonic() + 15
    while scrape(server)[key] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(server)[key] == before + 1
