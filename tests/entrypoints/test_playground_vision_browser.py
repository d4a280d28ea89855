"""The playground's image attachment in a real browser (Debian's headless chromium) against a tiny LLaVA server:
the attached picture goes out as an image_url content part, shows in the conversation, changes the answer, and
stays in the history for the next turn."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from helpers.vlm_helpers import make_tiny_llava, random_image

pytestmark = pytest.mark.slow  # a server and a browser

CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAST_ANSWER = "document.querySelector('article.message.assistant:last-of-type')"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, remote_server_cls):
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install -y chromium (make test does it)")
    path, _, _ = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    server = remote_server_cls(["--model", path, "--served-model-name", "tiny-vlm", "--max-model-len", "256"])
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            pg = browser.new_page()
            errors: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.set_default_timeout(30_000)
            pg.goto(server.url + "/")
            yield pg
            browser.close()
            assert not errors, f"JavaScript errors on the page: {errors}"
    finally:
        server.stop(signal.SIGKILL)


def _ask(page, text: str) -> str:
    before = page.evaluate("() => document.querySelectorAll('article.message.assistant').length")
    page.fill("#message", text)
    page.click("#send")
    page.wait_for_function(f"() => document.querySelectorAll('article.message.assistant').length > {before} && "
                           "document.querySelector('#stop').disabled && "
                           f"{LAST_ANSWER}.querySelector('.stats').textContent.includes('tokens')")
    return page.evaluate(f"() => {LAST_ANSWER}.querySelector('.content').textContent")


def test_an_attached_image_is_sent_shown_and_kept_in_the_history(page, tmp_path) -> None:
    page.wait_for_function("() => document.querySelector('#model').value === 'tiny-vlm'")
    page.fill("#max-tokens", "6")
    page.fill("#temperature", "0")
    answers = []
    for seed in (1, 2):
        page.click("#new-chat")
        picture = tmp_path / f"picture{seed}.png"
        random_image(seed).save(picture)
        page.set_input_files("#image-file", str(picture))
        page.wait_for_function("() => !document.querySelector('#image-preview').hidden")
        answers.append(_ask(page, "t5 t9"))
        assert page.evaluate("() => [...document.querySelectorAll('article.message.user')].pop()"
                             ".querySelector('img.attached') !== null")
        assert page.evaluate("() => document.querySelector('#image-preview').hidden")  # sent: attachment cleared
    assert answers[0] and answers[1] and answers[0] != answers[1]  # the picture changed the answer
    # A follow-up turn without an image: the first turn's picture still rides in the history.
    assert _ask(page, "t7")
    assert page.evaluate("() => document.querySelectorAll('article.message.assistant .error').length") == 0
