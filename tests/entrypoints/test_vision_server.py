"""One `pagedllm serve` of a tiny LLaVA: a data: URL image in chat through the openai client equals transformers,
and every bad image input is a 400 naming the problem with the server healthy after."""

from __future__ import annotations

import httpx
import openai
import pytest

from helpers.vlm_helpers import hf_generate, make_tiny_llava, png_data_url, random_image

pytestmark = pytest.mark.slow  # a server start (~40 s on a busy 2-core machine)

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, remote_server_cls):
    path, hf, processor = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    server = remote_server_cls(["--model", path, "--served-model-name", "tiny-vlm", "--block-size", "4",
                                "--max-model-len", "256", "--limit-mm-per-prompt", '{"image": 2}'])
    try:
        yield server, hf, processor
    finally:
        server.stop()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "t5 t9"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "t7 t33 t45"}]}]


def _chat(client, messages: list[dict]):
    return client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0.0, logprobs=True, extra_body={"ignore_eos": True})


def test_data_url_image_in_chat_equals_transformers_and_bad_inputs_are_400s(vlm) -> None:
    server, hf, processor = vlm
    client = server.client()
    ids = {}
    for seed in (1, 2):
        image = random_image(seed)
        out = _chat(client, _messages(png_data_url(image)))
        tokens = [int(t.token.removeprefix("t")) for t in out.choices[0].logprobs.content]
        assert tokens == hf_generate(hf, processor, "t5 t9 <image> t7 t33 t45", [image], MAX_TOKENS)
        assert out.usage.prompt_tokens == 2 + 16 + 3
        ids[seed] = tokens
    assert ids[1] != ids[2]
    again = _chat(client, _messages(png_data_url(random_image(1))))
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same image: a prefix-cache hit
    stream = client.chat.completions.create(model="tiny-vlm", messages=_messages(png_data_url(random_image(1))),
                                            max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == again.choices[0].message.content

    bad = {
        "data:image/png;base64,aGVsbG8=": "not an image that can be decoded",
        "data:text/plain;base64,aGVsbG8=": "not an image",
        "https://evil.example.com/cat.png": "fetching http(s) URLs is off",
        "file:///etc/hostname": "file:// URLs are off",
    }
    for url, message in bad.items():
        with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _chat(client, _messages(url))
    url = png_data_url(random_image(3))
    with pytest.raises(openai.BadRequestError, match="limit-mm-per-prompt allows 2"):
        _chat(client, _messages(url, url, url))
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert _chat(client, _messages(png_data_url(random_image(2)))).choices[0].message.content is not None
