"""LLaVA-NeXT (LLaVA 1.6): LLaVA's CLIP tower, projector and decoder over any-resolution grids.

    image -> the processor's tiles: the picture resized to the best of ``image_grid_pinpoints`` and cut into
             tower-sized tiles (a grid of gh x gw), plus the whole picture at tower size (the base tile)
          -> CLIP tower + projector per tile (as LLaVA) -> [tiles, patches, hidden]
          -> the base tile's rows, then the grid's rows laid out as one picture of (gh * side) x (gw * side)
             patches, the rows and columns the processor padded cut away again, ``image_newline`` after each row
    prompt: ``<image>`` expanded by the processor into exactly that many image tokens

transformers' own helpers give the grid shape, the tile count and the unpadding (``modeling_llava_next``), so the
layout is the reference's by construction; the weights are LLaVA's plus ``image_newline``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.model_executor.models.llava import LlavaForConditionalGeneration


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    checkpoint_prefixes = (*LlavaForConditionalGeneration.checkpoint_prefixes,
                           ("model.image_newline", "image_newline"))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__(hf_config, dtype, quant_config)
        if self.select_strategy != "default":
            raise ValueError("LLaVA-NeXT: vision_feature_select_strategy 'full' is not supported (the grid layout "
                             "takes the patches without the class token)")
        self.image_grid_pinpoints = [list(p) for p in hf_config.image_grid_pinpoints]
        self.tile_size = int(hf_config.vision_config.image_size)
        self.patches_per_side = self.tile_size // int(hf_config.vision_config.patch_size)
        self.image_newline = nn.Parameter(torch.zeros(hf_config.text_config.hidden_size, dtype=dtype),
                                          requires_grad=False)

    @torch.inference_mode()
    def embed_images(self, images: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Each image's processor output ({"pixel_values": [1, tiles (maybe padded), C, S, S], "image_sizes":
        [1, 2] (height, width)}) -> its embeddings [image tokens, text hidden], in the prompt's order."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        tiles, sizes = [], []
        for image in images:
            size = [int(v) for v in np.asarray(image["image_sizes"]).reshape(2)]
            count = image_size_to_num_patches(size, self.image_grid_pinpoints, self.tile_size)
            pixels = np.asarray(image["pixel_values"])  # tiles past ``count`` pad a prompt's images to one shape
            tiles.append(torch.as_tensor(pixels.reshape(-1, *pixels.shape[-3:])[:count]))
            sizes.append(size)
        per_tile = super().embed_images([{"pixel_values": t[None]} for t in torch.cat(tiles).unbind(0)])
        out, at = [], 0
        for image_tiles, size in zip(tiles, sizes):
            out.append(self._pack(torch.stack(per_tile[at:at + len(image_tiles)]), size))
            at += len(image_tiles)
        return out

    def _pack(self, features: torch.Tensor, size: list[int]) -> torch.Tensor:
        """features: [tiles, patches, hidden] of one image (base tile first); size: its (height, width) ->
        [tokens, hidden]: the base tile's rows, then the unpadded grid row by row, each row closed by
        ``image_newline``."""
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        base, grid = features[0], features[1:]
        newline = self.image_newline.to(features.dtype)
        if not len(grid):
            return torch.cat([base, newline[None]])
        side = self.patches_per_side
        rows, cols = get_anyres_image_grid_shape(size, self.image_grid_pinpoints, self.tile_size)
        hidden = grid.shape[-1]
        # [gh, gw, side, side, hidden] -> one picture [hidden, gh * side, gw * side]
        picture = grid.view(rows, cols, side, side, hidden).permute(4, 0, 2, 1, 3).reshape(hidden, rows * side,
                                                                                           cols * side)
        picture = unpad_image(picture, size)
        h, w = picture.shape[1:]
        with_newlines = torch.cat([picture, newline[:, None, None].expand(hidden, h, 1)], dim=2)
        return torch.cat([base, with_newlines.reshape(hidden, h * (w + 1)).t()])
