"""`pagedllm serve` of a tiny Gemma 3 multimodal model with the engine in its own process: a step budget that would
end a chunk inside the image (the scheduler's rule travels with the engine's config), and chat with a data: URL
image equals transformers, streamed or not."""

from __future__ import annotations

import pytest

from helpers.vlm_helpers import hf_generate, make_tiny_gemma3_mm, png_data_url, random_image

pytestmark = pytest.mark.slow  # a server start

MAX_TOKENS = 6
TEXT = "t5 t9 t11 t12 t13 t14 <start_of_image> t7 t33"  # the image's run at 7..22: a 20-token step would split it


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, remote_server_cls):
    path, hf, processor = make_tiny_gemma3_mm(tmp_path_factory.mktemp("gemma3mm"))
    server = remote_server_cls(["--model", path, "--served-model-name", "tiny-gemma3", "--block-size", "4",
                                "--max-model-len", "256", "--max-num-batched-tokens", "20"])
    try:
        yield server, hf, processor
    finally:
        server.stop()


def test_chat_with_an_image_equals_transformers_through_the_engine_process(served) -> None:
    server, hf, processor = served
    client = server.client()
    answers = []
    for seed in (1, 2):
        image = random_image(seed)
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "t5 t9 t11 t12 t13 t14"},
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": "t7 t33"}]}]
        out = client.chat.completions.create(model="tiny-gemma3", messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0.0, logprobs=True, extra_body={"ignore_eos": True})
        tokens = [int(t.token.removeprefix("t")) for t in out.choices[0].logprobs.content]
        assert tokens == hf_generate(hf, processor, TEXT, [image], MAX_TOKENS)
        stream = client.chat.completions.create(model="tiny-gemma3", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content
        answers.append(tokens)
    assert answers[0] != answers[1]
