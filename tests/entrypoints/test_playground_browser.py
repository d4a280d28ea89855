"""The playground in a real browser: Playwright drives Debian's headless chromium against a real server.

Never skipped: without chromium or playwright these tests fail and say how to install them (`make test`
installs both). Screenshots go to $PAGEDLLM_TEST_ARTEFACTS (default: tmp/artefacts in the repository).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

# Starts a server on the default model and a browser. Deselected by -m "not slow" (the fast subset).
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]

KEY = "browser-test-key"
MODEL = "playground-model"
CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTEFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTEFACTS", REPO_ROOT / "tmp" / "artefacts"))
FREE_RGB = (0xD1, 0xD5, 0xDB)  # kvmap.js STATE_COLOURS
CACHED_RGB = (0x7C, 0x8A, 0xA5)
LONG_PROMPT = "Write a very long story about a lighthouse keeper and the sea. " * 4


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[test]' (make test does it)")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install -y chromium (make test does it), "
                    "or point PAGEDLLM_CHROMIUM at a Chromium binary")
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def app_server(remote_server_cls):
    srv = remote_server_cls(["--served-model-name", MODEL, "--api-key", KEY])
    try:
        yield srv
    finally:
        srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def page(browser, app_server):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
    pg.set_default_timeout(20_000)
    pg.goto(app_server.url + "/")
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def wait_js(page, expression: str, timeout: float = 20_000) -> None:
    """Wait until the JS expression is truthy. Passed as a function: the page's CSP forbids eval()."""
    page.wait_for_function(f"() => ({expression})", timeout=timeout)


LAST_ANSWER = "document.querySelector('article.message.assistant:last-of-type')"


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTEFACTS / f"playground-{name}.png"), full_page=True)


def test_asks_for_the_key_then_lists_models(page):
    form = page.locator("#key-form")
    form.wait_for(state="visible")
    assert "API key" in page.locator("#key-status").inner_text()
    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Use key").click()
    wait_js(page, f"document.querySelector('#model').value === '{MODEL}'")
    assert page.evaluate("sessionStorage.getItem('pagedllm.apiKey')") == KEY
    assert "Connected" in page.locator("#conn-status").inner_text()


def test_markdown_renderer_is_safe_and_renders(page):
    result = page.evaluate("""async () => {
        const { renderMarkdown } = await import('/playground/markdown.js');
        const box = document.createElement('div');
        box.append(renderMarkdown([
            '<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>',
            '[click](javascript:window.pwned=3) [ok](https://example.com/a?b=1)',
            '**bold** and *it* and `x<y>`',
            '',
            '- one',
            '- two',
            '  - nested',
            '1. first',
            '',
            '```python',
            'print("<b>hi</b>")',
            '```',
            '',
            '    indented = 1',
        ].join('\\n')));
        return {
            html: box.innerHTML, text: box.textContent,
            img: box.querySelectorAll('img').length, script: box.querySelectorAll('script').length,
            hrefs: [...box.querySelectorAll('a')].map(a => a.getAttribute('href')),
            strong: box.querySelector('strong')?.textContent, em: box.querySelector('em')?.textContent,
            code: box.querySelector('p code')?.textContent,
            items: box.querySelector('ul').children.length, nested: box.querySelectorAll('ul ul li').length,
            ol: box.querySelectorAll('ol > li').length,
            pre: box.querySelector('pre code.language-python')?.textContent,
            indented: [...box.querySelectorAll('pre code')].map(c => c.textContent),
            pwned: window.pwned ?? null,
        };
    }""")
    assert result["img"] == 0 and result["script"] == 0 and result["pwned"] is None
    assert "<img src=x" in result["text"] and "<script>" in result["text"]  # shown as text
    assert result["hrefs"] == ["https://example.com/a?b=1"]
    assert "javascript:" in result["text"]  # the unsafe link stays visible as text, not clickable
    assert result["strong"] == "bold" and result["em"] == "it" and result["code"] == "x<y>"
    assert result["items"] == 2 and result["nested"] == 1 and result["ol"] == 1
    assert result["pre"] == 'print("<b>hi</b>")'
    assert result["indented"] == ['print("<b>hi</b>")', "indented = 1"]


def set_params(page, max_tokens: int, extra: str = "") -> None:
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill(str(max_tokens))
    if not page.locator("#extra-body").is_visible():
        page.locator("details.advanced summary").click()
    page.locator("#extra-body").fill(extra)


def test_chat_streams_an_answer_with_ttft_and_speed(page):
    set_params(page, 16)
    page.get_by_label("System prompt").fill("You are terse.")
    page.get_by_label("Message").fill("Name a colour.")
    page.keyboard.press("Enter")
    answer = page.locator("article.message.assistant").last
    wait_js(page, f"{LAST_ANSWER}?.dataset.state === 'done'")
    assert answer.locator(".content").inner_text().strip()
    stats = answer.locator(".stats").inner_text()
    assert re.search(r"TTFT \d+ ms", stats) and re.search(r"[\d.]+ tok/s", stats), stats
    assert re.search(r"\b\d+ tokens", stats) and "≈" not in stats  # exact count from the usage chunk
    assert page.locator("article.message.user").count() == 1
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    shot(page, "chat")


def test_raw_completion_mode(page):
    page.get_by_role("radio", name="Raw completion").check()
    assert page.locator("#system-field").is_hidden()
    set_params(page, 8)
    page.get_by_label(re.compile("^Prompt")).fill("The capital of France is")
    page.get_by_role("button", name="Send").click()
    wait_js(page, f"{LAST_ANSWER}?.dataset.state === 'done'")
    answer = page.locator("article.message.assistant").last
    text = answer.locator(".content").inner_text()
    assert text.startswith("The capital of France is") and len(text) > len("The capital of France is")
    assert "TTFT" in answer.locator(".stats").inner_text()
    page.get_by_role("radio", name="Chat").check()


def canvas_pixel(page, block: int) -> tuple[int, int, int]:
    return tuple(page.evaluate("""(block) => {
        const c = document.getElementById('kv-canvas');
        const cell = +c.dataset.cell, cols = +c.dataset.cols, dpr = window.devicePixelRatio || 1;
        const x = (block % cols) * cell + cell / 2, y = Math.floor(block / cols) * cell + cell / 2;
        return [...c.getContext('2d').getImageData(Math.floor(x * dpr), Math.floor(y * dpr), 1, 1).data]
            .slice(0, 3);
    }""", block))


def blocks_of(page, request_id: str) -> tuple[int, list[int]]:
    """The snapshot's seq and the block ids the request holds in it, from the endpoint the page reads (with the
    page's key). The snapshot may be newer than the one the map shows: wait for the map's seq before reading pixels."""
    return page.evaluate("""async (rid) => {
        const r = await fetch('/v1/kv_cache/snapshot', {headers: {Authorization:
            'Bearer ' + sessionStorage.getItem('pagedllm.apiKey')}});
        const s = await r.json();
        const owner = s.owners.findIndex(o => o.id === rid);
        const out = []; let i = 0;
        for (const [state, o, n] of s.runs) { for (let k = 0; k < n; k++, i++) if (o === owner) out.push(i); }
        return [s.seq, owner < 0 ? [] : out];
    }""", request_id)


def test_kv_map_follows_a_request_and_stop_aborts_it(page):
    page.get_by_role("tab", name="KV cache").click()
    wait_js(page, "+document.getElementById('kv-view').dataset.seq > 0")
    assert page.locator("#kv-view").get_attribute("data-used") == "0"
    page.get_by_role("tab", name="Chat").click()

    set_params(page, 1500, '{"ignore_eos": true}')
    page.get_by_label("Message").fill(LONG_PROMPT)
    page.get_by_role("button", name="Send").click()
    answer = page.locator("article.message.assistant").last
    # Streamed text appears and keeps growing.
    wait_js(page, f"{LAST_ANSWER}?.querySelector('.content').textContent.length > 0")
    # The first token cleared the waiting line (it is cleared before the text is drawn).
    assert answer.locator(".stats").inner_text() == ""
    first_len = len(answer.locator(".content").inner_text())
    wait_js(page, f"{LAST_ANSWER}.querySelector('.content').textContent.length > {first_len + 10}")
    assert page.locator("#stop").is_enabled() and answer.get_attribute("data-state") is None
    request_id = answer.get_attribute("data-request-id")
    assert request_id and request_id.startswith("chatcmpl-")

    # The map shows the request's blocks in its own colour while it runs.
    page.get_by_role("tab", name="KV cache").click()
    wait_js(page, f"(document.getElementById('kv-view').dataset.owners || '').includes('{request_id}')")
    seq, held = blocks_of(page, request_id)
    assert held, "the running request holds no blocks"
    # A decoding request only gains blocks, so a map drawn from this snapshot or a later one colours all of them.
    wait_js(page, f"+document.getElementById('kv-view').dataset.seq >= {seq}")
    colours = {canvas_pixel(page, b) for b in held}
    assert FREE_RGB not in colours and CACHED_RGB not in colours, colours
    assert int(page.locator("#kv-view").get_attribute("data-used")) >= 1
    assert page.locator("#kv-running").inner_text() == "1"
    assert "(this tab)" in page.locator("#kv-owners").inner_text()
    shot(page, "kv-running")

    # Stop: the fetch is aborted, the server aborts the request, the blocks go back to free/cached.
    page.get_by_role("tab", name="Chat").click()
    stopped_at = time.monotonic()
    page.get_by_role("button", name="Stop").click()
    wait_js(page, f"{LAST_ANSWER}?.dataset.state === 'stopped'")
    assert "stopped" in answer.locator(".stats").inner_text()
    page.get_by_role("tab", name="KV cache").click()
    view = "document.getElementById('kv-view').dataset"
    wait_js(page, f"{view}.used === '0' && {view}.shared === '0' && {view}.owners === ''", timeout=15_000)
    assert time.monotonic() - stopped_at < 15
    assert page.locator("#kv-running").inner_text() == "0"
    after = {canvas_pixel(page, b) for b in held}
    assert after <= {FREE_RGB, CACHED_RGB}, after
    shot(page, "kv-after-stop")


def test_keyboard_and_labels(page):
    page.get_by_role("tab", name="KV cache").focus()
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("document.activeElement.id") == "tab-chat"
    assert page.locator("#panel-chat").is_visible() and page.locator("#panel-kv").is_hidden()
    page.keyboard.press("ArrowRight")
    assert page.locator("#panel-kv").is_visible()
    page.locator("#kv-canvas").focus()
    page.keyboard.press("ArrowRight")
    assert page.locator("#kv-inspector").inner_text().startswith("Block 1:")
    # Every form control has an accessible name.
    unnamed = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(e => !e.closest('[hidden]'))
        .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim())
        .map(e => e.id || e.outerHTML)""")
    assert unnamed == []
