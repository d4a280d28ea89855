"""Adapters through ``pagedllm serve`` (one server for the module): --lora-modules in both forms, /v1/models with
parents, a request's ``model`` picking its adapter (outputs equal transformers + peft), load / unload at run time
behind the API key, every bad input a 4xx in OpenAI's shape with the server still healthy, and the metrics."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import pytest

from helpers.arch_configs import save_word_tokenizer
from helpers.lora_helpers import make_adapter, peft_greedy
from helpers.model_helpers import make_tiny_llama

pytestmark = pytest.mark.slow  # one server start (~60 s on two cores)

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, *range(10, 45)]
MAX_TOKENS = 6


def _remote_server_cls():
    """``tests/entrypoints/conftest.py``'s RemoteServer (a module named conftest is already imported)."""
    spec = importlib.util.spec_from_file_location(
        "entrypoints_conftest", Path(__file__).resolve().parents[1] / "entrypoints" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RemoteServer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_llama(root / "base")
    save_word_tokenizer(base)
    adapters = {f"a{i}": make_adapter(base, root / f"a{i}", r=r, seed=20 + i) for i, r in enumerate((4, 8, 2))}
    big = make_adapter(base, root / "big", r=32, targets=["q_proj"])
    dora = make_adapter(base, root / "dora", r=4, targets=["q_proj"])
    config = json.loads((Path(dora) / "adapter_config.json").read_text())
    (Path(dora) / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    server = _remote_server_cls()([
        "--model", base, "--max-model-len", "128", "--served-model-name", "base", "--api-key", KEY,
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", f"a0={adapters['a0']}",
        json.dumps({"name": "a1", "path": adapters["a1"], "base_model_name": "base"})])
    try:
        yield server, base, adapters, {"big": big, "dora": dora}
    finally:
        server.stop()


def _complete(server, model: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def _text(base: str, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base).decode(ids).strip()


def _assert_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["code"] == status


def test_models_list_adapters_with_their_parent(served) -> None:
    server = served[0]
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]}
    assert cards["base"]["parent"] is None
    assert cards["a0"]["parent"] == "base" and cards["a1"]["parent"] == "base"


def test_model_name_picks_the_adapter(served) -> None:
    server, base, adapters, _ = served
    texts = {}
    for name in ("base", "a0", "a1"):
        response = _complete(server, name)
        assert response.status_code == 200, response.text
        texts[name] = response.json()["choices"][0]["text"].strip()
        assert response.json()["model"] == name
    assert texts["base"] == _text(base, peft_greedy(base, None, PROMPT, MAX_TOKENS))
    for name in ("a0", "a1"):
        assert texts[name] == _text(base, peft_greedy(base, adapters[name], PROMPT, MAX_TOKENS))
        assert texts[name] != texts["base"]


def test_unknown_model_is_a_404(served) -> None:
    _assert_error(_complete(served[0], "nope"), 404, "does not exist")


def test_load_use_and_unload_at_run_time(served) -> None:
    server, base, adapters, _ = served
    url = server.url
    load = {"lora_name": "late", "lora_path": adapters["a2"]}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401  # behind the key
    response = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, json=load)
    assert response.status_code == 200, response.text
    _assert_error(httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, json=load), 400, "already served")
    out = _complete(server, "late")
    want = _text(base, peft_greedy(base, adapters["a2"], PROMPT, MAX_TOKENS))
    assert out.json()["choices"][0]["text"].strip() == want
    assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "late"}).status_code == 200
    _assert_error(_complete(server, "late"), 404, "does not exist")
    _assert_error(httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "late"}), 404,
                  "not loaded")


def test_bad_adapters_are_4xx_and_the_server_stays_healthy(served, tmp_path) -> None:
    server, _, _, bad = served
    url = server.url

    def load(name: str, path: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, json={"lora_name": name, "lora_path": path})

    _assert_error(load("x", str(tmp_path / "missing")), 400, "is not a folder")
    _assert_error(load("x", bad["dora"]), 400, "DoRA")
    _assert_error(load("x", bad["big"]), 400, "above --max-lora-rank 16")
    _assert_error(load("base", bad["dora"]), 400, "already served")
    response = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "x"})
    assert response.status_code == 400 and "lora_path" in response.json()["error"]["message"]
    assert "x" not in {c["id"] for c in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}
    assert httpx.get(f"{url}/health").status_code == 200
    assert _complete(server, "a0").status_code == 200


def test_metrics_report_lora_requests_info(served) -> None:
    server = served[0]
    assert _complete(server, "a1").status_code == 200
    body = httpx.get(f"{server.url}/metrics").text
    lines = [line for line in body.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert lines and 'max_lora="2"' in lines[0], body[-2000:]
