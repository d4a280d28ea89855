"""``ImageTextLM``: what the vision-language families share on the text side: a decoder (``self.model``) that takes
image rows merged into its input embeddings, and checkpoint names mapped onto ours by prefix. Each family adds its
tower, ``embed_images`` and its ``checkpoint_prefixes``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedllm.model_executor.models.base import CausalLM


class ImageTextLM(CausalLM):
    #: (checkpoint prefix, ours) pairs, applied in order to every name (a name may match several).
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; inputs_embeds: [T, hidden] (image rows merged) or None -> hidden [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> token embeddings [T, hidden] (a fresh tensor the caller may write image rows into)."""
        return self.model.embed_tokens(input_ids)

    def our_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model's layout (None: not loaded)."""
        for old, new in self.checkpoint_prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((ours, tensor) for name, tensor in weights
                                    if (ours := self.our_name(name)) is not None)
