"""``pagedllm serve --tensor-parallel-size 2`` answers completions equal to one rank's (offline, TP=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.tp_helpers import PROMPTS, tiny


def _remote_server_cls():
    """``tests/entrypoints/conftest.py``'s RemoteServer (a module named conftest is already imported)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "entrypoints_conftest", Path(__file__).resolve().parents[1] / "entrypoints" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RemoteServer

pytestmark = pytest.mark.slow


def test_serve_tp2_completions_equal_tp1(tmp_path) -> None:
    from pagedllm import LLM, SamplingParams

    path = tiny("Qwen2ForCausalLM", tmp_path)
    prompts = [" ".join(f"t{i}" for i in p) for p in PROMPTS]
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=128, dtype="float32")
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                                           ignore_eos=True), use_tqdm=False)]
    server = _remote_server_cls()(["--model", path, "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                           "--max-model-len", "128"])
    try:
        client = server.client()
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        log = server.log()
    finally:
        server.stop()
    assert "tensor parallel: 2 ranks" in log
    assert got == want
