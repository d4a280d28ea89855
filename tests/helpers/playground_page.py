"""The playground in Debian's headless chromium for the chat tests: a page on a server's ``/`` that fails the test
on any JavaScript error, and one chat turn through it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LAST_ANSWER = "document.querySelector('article.message.assistant:last-of-type')"


@contextlib.contextmanager
def playground_page(url: str) -> Iterator[Any]:
    """A page at ``url + "/"``; JavaScript errors it raised fail the test when it closes."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install -y chromium (make test does it)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(30_000)
        page.goto(url + "/")
        yield page
        browser.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


def ask(page: Any, text: str) -> str:
    """Send ``text`` in the chat and wait for the whole answer; its text."""
    before = page.evaluate("() => document.querySelectorAll('article.message.assistant').length")
    page.fill("#message", text)
    page.click("#send")
    page.wait_for_function(f"() => document.querySelectorAll('article.message.assistant').length > {before} && "
                           "document.querySelector('#stop').disabled && "
                           f"{LAST_ANSWER}.querySelector('.stats').textContent.includes('tokens')")
    return page.evaluate(f"() => {LAST_ANSWER}.querySelector('.content').textContent")
