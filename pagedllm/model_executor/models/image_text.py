"""``ImageTextLM``: what the vision-language families share on the text side: a Llama-family decoder
(``self.model``) that takes image rows merged into its input embeddings. Each family adds its tower and
``embed_images``."""

from __future__ import annotations

import torch

from pagedllm.model_executor.models.base import CausalLM


class ImageTextLM(CausalLM):
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; inputs_embeds: [T, hidden] (image rows merged) or None -> hidden [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> token embeddings [T, hidden] (a fresh tensor the caller may write image rows into)."""
        return self.model.embed_tokens(input_ids)
