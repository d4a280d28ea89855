"""The playground's audio tab in a real browser (Debian's chromium through Playwright) against the real app with
a fake Whisper engine: upload a file, record from chromium's fake microphone (webm/Opus), see timed segments.

Never skipped: without chromium or playwright it fails and says how to install them (``make test`` does).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from helpers.whisper_fakes import FakeWhisperEngine, whisper_tokenizer

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 # A fake microphone (a beep) that needs no permission prompt: the recording path runs for real.
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
ARTEFACTS = Path(os.environ.get("PAGEDLLM_TEST_ARTEFACTS", REPO_ROOT / "tmp" / "artefacts"))


@pytest.fixture(scope="module")
def engine():
    return FakeWhisperEngine(whisper_tokenizer(), text=" Hello from the playground.", end_s=2.4)


@contextlib.contextmanager
def serve_app(engine):
    """The real app around ``engine`` on uvicorn, on a free loopback port, in a thread."""
    import uvicorn

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import ServerOptions, build_app

    from helpers.whisper_fakes import _free_port

    llm = AsyncLLM(engine)
    app = build_app(llm, ServerOptions(served_model_names=["whisper-base"]))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        llm.shutdown(1)


@pytest.fixture(scope="module")
def app_url(engine):
    with serve_app(engine) as url:
        yield url


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
def page(browser, app_url):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # The browser logs the 400 the bad-file test asks for, and the KV tab's 503 (the fake engine has no KV cache
    # to map), as failed resources; nothing else may be.
    expected = ("status of 400", "status of 503")
    pg.on("console", lambda m: errors.append(m.text)
          if m.type == "error" and not any(e in m.text for e in expected) else None)
    pg.set_default_timeout(20_000)
    pg.goto(app_url + "/#audio")
    pg.wait_for_function("() => document.querySelector('#model').value === 'whisper-base'")
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def test_upload_shows_timed_segments(page, engine, speech_wav, tmp_path):
    clip = tmp_path / "hello.wav"
    clip.write_bytes(speech_wav)
    assert page.locator("#panel-audio").is_visible() and not page.locator("#panel-chat").is_visible()
    page.set_input_files("#audio-file", str(clip))
    assert "hello.wav" in page.locator("#audio-clip").inner_text()
    before = len(engine.seen)
    page.get_by_role("button", name="Transcribe").click()
    page.wait_for_function("() => document.querySelectorAll('#audio-segments li').length === 1")
    assert page.locator("#audio-text").inner_text() == "Hello from the playground."
    assert page.locator("#audio-segments .seek").inner_text() == "00:00.0 → 00:02.4"
    assert page.locator("#audio-segments .seg-text").inner_text() == "Hello from the playground."
    assert page.locator("#audio-status").inner_text().startswith("english · 00:03.")
    v = engine.vocab
    prompts = [p for p, _, _ in engine.seen[before:]]
    assert prompts == [[v.sot], [v.sot, v.language_ids["en"], v.transcribe]]  # detection, then with timestamps
    page.screenshot(path=str(ARTEFACTS / "playground-audio.png"), full_page=True)


def test_record_translate_with_language(page, engine):
    page.get_by_label("Translate to English").check()
    page.get_by_label("Language (empty: detect)").fill("German")
    page.get_by_role("button", name="Record").click()
    page.wait_for_function("() => document.querySelector('#audio-record').getAttribute('aria-pressed') === 'true'")
    time.sleep(1.5)
    page.get_by_role("button", name="Stop recording").click()
    page.wait_for_function("() => document.querySelector('#audio-clip').textContent.includes('recording.')")
    before = len(engine.seen)
    page.locator("#audio-submit").click()
    page.wait_for_function("() => document.querySelector('#audio-status').textContent.startsWith('german')")
    v = engine.vocab
    [(prompt, features, _)] = engine.seen[before:]  # language given: no detection
    assert prompt == [v.sot, v.language_ids["de"], v.translate]
    assert features.std() > 0.05  # the fake microphone's beep, decoded from the browser's recording


def test_bad_file_shows_the_servers_error(page, tmp_path):
    bad = tmp_path / "notes.wav"
    bad.write_bytes(b"not audio at all " * 64)
    page.set_input_files("#audio-file", str(bad))
    page.locator("#audio-submit").click()
    page.wait_for_function("() => document.querySelector('#audio-error').textContent.includes('decode')")


def test_tabs_follow_the_model(page, browser):
    # A speech model: the audio tab is there and the arrow keys reach it.
    page.get_by_role("tab", name="Audio").focus()
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.id") == "tab-kv"
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("document.activeElement.id") == "tab-chat"
    # A text model: no audio tab, #audio falls back to the chat, and the arrow keys skip the hidden tab.
    text_engine = FakeWhisperEngine(whisper_tokenizer())
    text_engine.config.model.architecture = "LlamaForCausalLM"
    with serve_app(text_engine) as url:
        context = browser.new_context()
        other = context.new_page()
        other.goto(url + "/#audio")
        other.wait_for_function("() => document.querySelector('#conn-status').textContent.startsWith('Connected')")
        assert other.locator("#tab-audio").is_hidden() and other.locator("#panel-chat").is_visible()
        other.get_by_role("tab", name="KV cache").focus()
        other.keyboard.press("ArrowLeft")
        assert other.evaluate("document.activeElement.id") == "tab-chat"
        context.close()
