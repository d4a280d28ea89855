"""The image half of a transformers processor whose video half cannot be built here: Qwen2-VL's processor needs
torchvision for its video processor even for images. This pairs the model's own image processor
(``AutoImageProcessor``, Pillow-based: resizing, normalising, patching are transformers') with its tokenizer, and
expands each image token into the image's count as the processor does: grid patches / merge_size^2.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np


class ImageOnlyProcessor:
    """What ``MultiModalProcessor`` reads of an HF processor: ``__call__``, ``tokenizer``, ``image_processor``,
    ``image_token(_id)``, ``_get_num_multimodal_tokens``."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.merge = int(getattr(self.image_processor, "merge_size", 0) or 0)
        if not self.merge or not hasattr(self.image_processor, "get_number_of_image_patches"):
            raise ValueError(f"{type(self.image_processor).__name__} does not say how many tokens an image takes")
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))

    def __call__(self, text: str, images: list[Any] | None = None, return_tensors: str = "np",
                 add_special_tokens: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="np")
            out.update(pixels)
            counts = [int(c) // self.merge ** 2 for c in np.asarray(pixels["image_grid_thw"]).prod(axis=1)]
            pieces = text.split(self.image_token)
            if len(pieces) != len(counts) + 1:
                raise ValueError(f"{len(pieces) - 1} {self.image_token} for {len(counts)} images")
            text = pieces[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, pieces[1:]))
        out["input_ids"] = self.tokenizer(text, return_tensors="np", add_special_tokens=add_special_tokens)["input_ids"]
        return out

    def _get_num_multimodal_tokens(self, image_sizes: list[tuple[int, int]]) -> SimpleNamespace:
        patches = [int(self.image_processor.get_number_of_image_patches(h, w)) for h, w in image_sizes]
        return SimpleNamespace(num_image_tokens=[p // self.merge ** 2 for p in patches], num_image_patches=patches)
