"""The playground's adapter picker in a real browser (Debian's headless chromium) against a tiny Llama served with
LoRA adapters: adapters are listed in their own group under their base, picking one sends its name as the chat
request's model (the answer equals the API's for that adapter), and an adapter loaded at run time shows up when
the list is opened again."""

from __future__ import annotations

import signal

import httpx
import pytest

from helpers.arch_configs import save_word_tokenizer
from helpers.lora_helpers import make_adapter
from helpers.model_helpers import make_tiny_llama
from helpers.playground_page import ask, playground_page
from helpers.vlm_helpers import CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # a server and a browser

MESSAGE = "t5 t9 t11 t12 t13"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, remote_server_cls):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lora_playground")
    base = make_tiny_llama(root / "base")
    save_word_tokenizer(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = CHAT_TEMPLATE  # message texts joined: the word vocabulary has no roles
    tokenizer.save_pretrained(base)
    adapters = {name: make_adapter(base, root / name, r=8, seed=30 + i) for i, name in enumerate(("a0", "a1", "a2"))}
    server = remote_server_cls(["--model", base, "--served-model-name", "base", "--max-model-len", "128",
                                "--enable-lora", "--max-loras", "2", "--lora-modules", f"a0={adapters['a0']}",
                                f"a1={adapters['a1']}"])
    try:
        yield server, adapters
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def page(served):
    with playground_page(served[0].url) as pg:
        yield pg


def _api_answer(server, model: str) -> str:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_adapters_are_listed_under_their_base_and_picking_one_uses_it(served, page) -> None:
    server, _ = served
    page.wait_for_function("() => document.querySelectorAll('#model option').length === 3")
    options = page.evaluate("() => [...document.querySelectorAll('#model option')].map(o => "
                            "[o.value, o.textContent, o.parentElement.tagName === 'OPTGROUP'])")
    assert options == [["base", "base", False], ["a0", "a0 (adapter of base)", True],
                       ["a1", "a1 (adapter of base)", True]]
    assert "1 model, 2 adapters" in page.text_content("#conn-status")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#temperature", "0")
    answers = {}
    for model in ("base", "a1"):
        page.click("#new-chat")
        page.select_option("#model", model)
        answers[model] = ask(page, MESSAGE)
        assert answers[model] == _api_answer(server, model)
    assert answers["a1"] != answers["base"]  # the adapter changed the answer


def test_an_adapter_loaded_at_run_time_shows_up_when_the_list_is_opened(served, page) -> None:
    server, adapters = served
    page.select_option("#model", "a0")
    response = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": "a2", "lora_path": adapters["a2"]})
    assert response.status_code == 200, response.text
    page.focus("#message")
    page.focus("#model")
    page.wait_for_function("() => [...document.querySelectorAll('#model option')].some(o => o.value === 'a2')")
    assert page.evaluate("() => document.querySelector('#model').value") == "a0"  # the choice survives
