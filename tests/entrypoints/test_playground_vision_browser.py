"""The playground's image attachment in a real browser (Debian's headless chromium) against a tiny LLaVA server:
the attached picture goes out as an image_url content part, shows in the conversation, changes the answer, and
stays in the history for the next turn."""

from __future__ import annotations

import signal

import pytest

from helpers.playground_page import ask, playground_page
from helpers.vlm_helpers import make_tiny_llava, random_image

pytestmark = pytest.mark.slow  # a server and a browser



@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, remote_server_cls):
    path, _, _ = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    server = remote_server_cls(["--model", path, "--served-model-name", "tiny-vlm", "--max-model-len", "256"])
    try:
        with playground_page(server.url) as pg:
            yield pg
    finally:
        server.stop(signal.SIGKILL)


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
        answers.append(ask(page, "t5 t9"))
        assert page.evaluate("() => [...document.querySelectorAll('article.message.user')].pop()"
                             ".querySelector('img.attached') !== null")
        assert page.evaluate("() => document.querySelector('#image-preview').hidden")  # sent: attachment cleared
    assert answers[0] and answers[1] and answers[0] != answers[1]  # the picture changed the answer
    # A follow-up turn without an image: the first turn's picture still rides in the history.
    assert ask(page, "t7")
    assert page.evaluate("() => document.querySelectorAll('article.message.assistant .error').length") == 0
