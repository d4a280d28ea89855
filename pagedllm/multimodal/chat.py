"""OpenAI chat content parts -> messages for a chat template, and the images they reference.

A message's ``content`` is a string or a list of parts: ``{"type": "text", "text": ...}``,
``{"type": "image_url", "image_url": {"url": ...}}`` (OpenAI's; a bare string URL is taken too) and, offline,
``{"type": "image_pil", "image_pil": PIL.Image}`` (vLLM's). For a vision-language model each image part becomes
``{"type": "image"}``, the part HF chat templates turn into the model's image placeholder; for a text model the
text parts are joined and an image part is an error naming the model.
"""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.media import MediaPolicy, load_image

IMAGE_PART_TYPES = ("image_url", "image_pil")


def parse_chat_messages(messages: list[dict[str, Any]], multimodal: bool, model_name: str = "this model"
                        ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the chat template, the image references in order: URL strings or PIL images).

    ValueError naming ``messages`` (or ``image_url``) for content that cannot be used."""
    conversation, images = [], []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("messages: each message needs a string 'role'")
        content = message.get("content")
        if content is None or isinstance(content, str):
            conversation.append(dict(message))
            continue
        if not isinstance(content, list):
            raise ValueError("messages: content must be a string or a list of content parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PART_TYPES:
                if not multimodal:
                    raise ValueError(f"image_url: model {model_name!r} takes text only; send images to a "
                                     "vision-language model (see `pagedllm models`, INPUTS text+image)")
                images.append(_image_reference(part, kind))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"messages: content part type {kind!r} is not supported (text, image_url)")
        if multimodal:
            conversation.append({**message, "content": parts})
        else:
            conversation.append({**message, "content": "\n".join(p["text"] for p in parts)})
    return conversation, images


def _image_reference(part: dict[str, Any], kind: str) -> Any:
    if kind == "image_pil":
        return part.get("image_pil")
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ValueError("image_url: expected {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}")
    return url


def load_images(references: list[Any], policy: MediaPolicy) -> list[Any]:
    """Decoded pictures for ``parse_chat_messages``' references (URLs fetched or decoded as ``policy`` allows)."""
    from PIL import Image

    images = []
    for ref in references:
        if isinstance(ref, Image.Image):
            images.append(ref)
        elif isinstance(ref, str):
            images.append(load_image(ref, policy))
        else:
            raise ValueError(f"image_pil: expected a PIL image, got {type(ref).__name__}")
    return images
