"""The playground's audio tab in a real browser (Debian's chromium through Playwright) against the real app with
a fake Whisper engine: upload a file, record from chromium's fake microphone (webm/Opus), see timed segments.

Never skipped: without chromium or playwright it fails and says how to install them (``make test`` does).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from whisper_fakes import FakeWhisperEngine, whisper_tokenizer

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


@pytest.fixture(scope="module")
def app_url(engine):
    import uvicorn
    from whisper_fakes import _free_port

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import ServerOptions, build_app

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
def page(app_url):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[test]' (make test does it)")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium not found at {CHROMIUM}: apt-get install -y chromium (make test does it), "
                    "or point PAGEDLLM_CHROMIUM at a Chromium binary")
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        pg = context.new_page()
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        # The 400 the bad-file test asks for is logged by the browser as a failed resource; nothing else may be.
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" and "400" not in m.text else None)
        pg.set_default_timeout(20_000)
        pg.goto(app_url + "/#audio")
        pg.wait_for_function("() => document.querySelector('#model').value === 'whisper-base'")
        yield pg
        context.close()
        browser.close()
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
