"""Image URLs under the media policy, chat content parts, content hashes: no model needed."""

from __future__ import annotations

import base64

import pytest

from pagedllm.multimodal.chat import load_images, parse_chat_messages
from pagedllm.multimodal.hashing import image_content_hash
from pagedllm.multimodal.media import MediaPolicy, load_image

from helpers.vlm_helpers import png_data_url, random_image

OFF = MediaPolicy()


def test_data_url_decodes_to_the_same_pixels() -> None:
    image = random_image(1)
    decoded = load_image(png_data_url(image), OFF)
    assert decoded.size == image.size and decoded.tobytes() == image.tobytes()
    assert image_content_hash(decoded) == image_content_hash(image)
    assert image_content_hash(random_image(2)) != image_content_hash(image)


@pytest.mark.parametrize(("url", "message"), [
    ("data:text/plain;base64,aGVsbG8=", "media type is 'text/plain', not an image"),
    ("data:image/png;base64,@@@", "base64 data is malformed"),
    ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "not an image that can be decoded"),
    ("data:image/png,raw", "must be base64-encoded"),
    ("https://example.com/cat.png", "fetching http(s) URLs is off"),
    ("file:///etc/passwd", "file:// URLs are off"),
    ("ftp://example.com/cat.png", "unsupported URL scheme"),
])
def test_bad_image_urls_are_refused_naming_the_problem(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"image_url: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        load_image(url, OFF)


def test_local_files_only_under_the_allowed_folder(tmp_path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    random_image(3).save(allowed / "pic.png")
    random_image(4).save(tmp_path / "outside.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed}/pic.png", policy).tobytes() == random_image(3).tobytes()
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        load_image(f"file://{allowed}/../outside.png", policy)


def test_http_only_from_allowed_domains() -> None:
    policy = MediaPolicy(allowed_media_domains=("images.example.org",))
    with pytest.raises(ValueError, match="domain 'evil.example.com' is not in --allowed-media-domains"):
        load_image("https://evil.example.com/x.png", policy)


def test_chat_parts_become_template_parts_and_image_references() -> None:
    url = png_data_url(random_image(5))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "this?"}]}]
    conv, refs = parse_chat_messages(messages, multimodal=True)
    assert conv[1]["content"] == [{"type": "text", "text": "what is"}, {"type": "image"},
                                  {"type": "text", "text": "this?"}]
    assert refs == [url]
    assert load_images(refs, OFF)[0].tobytes() == random_image(5).tobytes()
    text_only, none = parse_chat_messages([messages[0], {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], multimodal=False)
    assert text_only[1]["content"] == "a\nb" and none == []
    with pytest.raises(ValueError, match="model 'tiny' takes text only"):
        parse_chat_messages(messages, multimodal=False, model_name="tiny")
    with pytest.raises(ValueError, match="content part type 'video_url' is not supported"):
        parse_chat_messages([{"role": "user", "content": [{"type": "video_url"}]}], multimodal=True)
