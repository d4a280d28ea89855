"""A multimodal prompt through the model's own HF processor: pixels preprocessed (resize, crop, normalize: all
transformers'), each image's placeholder expanded to its tokens, and one ``MultiModalFeature`` per image with its
placeholder run, content hash and processed pixels.

The processor is ``AutoProcessor`` from the model's folder, loaded once in the front end (the API process): the
engine core receives token ids with the placeholders expanded and the features, never images.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.core.multimodal import MultiModalFeature
from pagedllm.logger import init_logger
from pagedllm.multimodal.hashing import image_content_hash
from pagedllm.multimodal.image_only_processor import ImageOnlyProcessor

logger = init_logger(__name__)

# Processor outputs that describe the text, not an image.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def as_image_list(data: Any) -> list[Any]:
    """``multi_modal_data["image"]``: one PIL image or a list of them; ValueError for anything else."""
    from PIL import Image

    images = data if isinstance(data, (list, tuple)) else [data]
    for image in images:
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data: 'image' takes PIL images, got {type(image).__name__}")
    return [image.convert("RGB") if image.mode != "RGB" else image for image in images]


def load_hf_processor(model_path: str) -> Any:
    """The model's ``AutoProcessor``; where its video half needs torchvision and that is missing (Qwen2-VL), the
    image half alone (``ImageOnlyProcessor``), said in the log."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, local_files_only=True)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        try:
            processor = ImageOnlyProcessor(model_path)
        except (OSError, ValueError):
            raise e from None
        logger.warning("multimodal processor: AutoProcessor failed (%s: %s); using the model's image processor and "
                       "tokenizer (images only)", type(e).__name__, str(e)[:120])
        return processor


class MultiModalProcessor:
    """``limits``: most items of each modality one prompt may carry (``--limit-mm-per-prompt``)."""

    def __init__(self, model_path: str, limits: dict[str, int] | None = None) -> None:
        self.hf_processor = load_hf_processor(model_path)
        self.limits = dict(limits or {})
        tokenizer = self.hf_processor.tokenizer
        self.image_token = getattr(self.hf_processor, "image_token", None) or "<image>"
        # The token the processor expands an image into (Gemma 3's differs from its placeholder: image_token_ids).
        expanded = (getattr(self.hf_processor, "image_token_ids", None) or [None])[0]
        self.image_token_id = int(expanded if expanded is not None else
                                  getattr(self.hf_processor, "image_token_id", None)
                                  or tokenizer.convert_tokens_to_ids(self.image_token))
        logger.info("multimodal processor: %s with %s (placeholder %r, image token id %d)",
                    type(self.hf_processor).__name__, type(self.hf_processor.image_processor).__name__,
                    self.image_token, self.image_token_id)

    def check_limit(self, modality: str, count: int) -> None:
        limit = self.limits.get(modality)
        if limit is not None and count > limit:
            raise ValueError(f"multi_modal_data: {count} {modality}s in one prompt; --limit-mm-per-prompt allows "
                             f"{limit}")

    def process(self, text: str, images: list[Any], add_special_tokens: bool = True
                ) -> tuple[list[int], list[MultiModalFeature]]:
        """(prompt token ids with each image's placeholder run, one feature per image in prompt order).

        ``text`` holds one image token (e.g. ``<image>``) per image."""
        self.check_limit("image", len(images))
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(f"prompt: it holds {found} {self.image_token} placeholder(s) for {len(images)} image(s); "
                             f"put one {self.image_token} where each image goes")
        try:
            out = self.hf_processor(text=text, images=images or None, return_tensors="np",
                                    add_special_tokens=add_special_tokens)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"prompt: the model's processor refused it: {e}") from None
        token_ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        if not images:
            return token_ids, []
        sizes = [(image.height, image.width) for image in images]
        counts = self.hf_processor._get_num_multimodal_tokens(image_sizes=sizes)
        lengths = list(counts.num_image_tokens)
        per_image = _split_per_image({k: v for k, v in out.items() if k not in _TEXT_KEYS}, len(images),
                                     getattr(counts, "num_image_patches", None))
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(positions) != sum(lengths):
            raise ValueError(f"prompt: the processor expanded {len(images)} image(s) into {len(positions)} image "
                             f"tokens, expected {sum(lengths)}")
        features, used = [], 0
        for image, count, data in zip(images, lengths, per_image):
            mine = positions[used:used + count]  # this image's tokens: a span from its first to its last
            used += count
            offset, end = mine[0], mine[-1] + 1
            mask = None
            if end - offset != count:  # other tokens between its tiles (row / column tags)
                mask = bytes(int(t == self.image_token_id) for t in token_ids[offset:end])
            features.append(MultiModalFeature(image_content_hash(image), offset, end - offset, "image", data, mask))
        return token_ids, features


def _split_per_image(arrays: dict[str, Any], n: int, patches: list[int] | None) -> list[dict[str, np.ndarray]]:
    """The processor's outputs as one dict per image: [n, ...] arrays by rows (one image each: LLaVA), the
    prompt's [1, tiles, ...] arrays by each image's tiles (``patches``: Idefics3), or [patches, features] arrays by
    each image's patch rows (Qwen2-VL)."""
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name, value in arrays.items():
        array = np.asarray(value)
        if array.ndim == 2 and patches and sum(patches) == array.shape[0] != n:
            # [all images' patches, features] (Qwen2-VL): each image's rows
            bounds = np.cumsum([0, *patches])
            pieces = [array[bounds[i]:bounds[i + 1]] for i in range(n)]
        elif array.ndim and array.shape[0] == n:
            pieces = [array[i:i + 1] for i in range(n)]
        elif array.ndim > 1 and array.shape[0] == 1 and patches and sum(patches) == array.shape[1]:
            bounds = np.cumsum([0, *patches])
            pieces = [array[:, bounds[i]:bounds[i + 1]] for i in range(n)]
        else:
            raise ValueError(f"prompt: the processor's {name!r} of shape {list(array.shape)} does not split into "
                             f"{n} images")
        for i, piece in enumerate(pieces):
            out[i][name] = np.ascontiguousarray(piece)
    return out

