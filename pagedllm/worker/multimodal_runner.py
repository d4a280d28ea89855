"""The model runner's multimodal part: the encoder cache, vision encoder runs, image rows merged into a step's
input embeddings.

The encoder cache maps an image's content hash to its encoder output ([tokens, hidden], the projector's output):
an image is encoded once (its first step that computes any of its tokens; the step's new images in one batched
call), then every chunk of any request that sends it reads its rows from here. The scheduler owns the bound
(``core/encoder_cache.py``) and names the entries to drop (``SchedulerOutput.free_encoder_hashes``); the runner
only follows, except that an entry it lacks (a step that failed before storing it) is encoded again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.logger import init_logger

logger = init_logger(__name__)

# Images encoded in one call: bounds the vision tower's activations for a burst of new images.
ENCODER_BATCH = 16


class MultiModalRunner:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cache: dict[str, torch.Tensor] = {}  # content hash -> [tokens, hidden]
        self.num_encoded_images = 0  # encoder runs, one per image (tests and logs count them)
        self.num_encoder_calls = 0  # batched calls of the vision encoder
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))  # Qwen2-VL: 3-axis text positions
        # Gemma 3: each image's tokens attend to each other both ways (attention/backends/bidirectional_runs.py).
        self.bidirectional = bool(getattr(model, "image_tokens_attend_bidirectionally", False))

    def free(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            self.cache.pop(identifier, None)

    def input_embeddings(self, states: list[Any], query_lens: list[int], input_ids: torch.Tensor
                         ) -> torch.Tensor | None:
        """The step's input embeddings [T, hidden] with image rows merged, or None when no scheduled token is an
        image's (the plain text step). ``states[i]`` computes ``query_lens[i]`` tokens from its
        ``num_computed_tokens``, in the order of ``input_ids``."""
        pieces: list[tuple[Any, int, int, int]] = []  # (image, first span position, positions, row in the step)
        missing: dict[str, Any] = {}
        row = 0
        for state, q in zip(states, query_lens):
            start = state.num_computed_tokens
            for feature in state.mm_features:
                if feature.overlaps(start, start + q):
                    lo, hi = max(start, feature.offset), min(start + q, feature.end)
                    pieces.append((feature, lo - feature.offset, hi - lo, row + lo - start))
                    if feature.identifier not in self.cache:
                        missing[feature.identifier] = feature
            row += q
        if not pieces:
            return None
        self._encode(list(missing.values()))
        embeds = self.model.embed_input_ids(input_ids)
        for feature, first, count, at in pieces:
            output = self.cache[feature.identifier]
            if feature.embed_mask is None:
                embeds[at:at + count] = output[first:first + count]
                continue
            # Only the masked positions take rows: row k of the output goes to the k-th masked position.
            mask = np.frombuffer(feature.embed_mask, dtype=np.uint8).astype(bool)
            rows = np.cumsum(mask) - 1
            picked = np.nonzero(mask[first:first + count])[0]
            if len(picked):
                embeds[torch.from_numpy(at + picked)] = output[torch.from_numpy(rows[first + picked])]
        return embeds

    def mark_bidirectional_runs(self, meta: Any, states: list[Any], query_lens: list[int]) -> None:
        """For a model whose image tokens attend to each other both ways: name on every KV cache group's metadata
        the step's rows of image runs, each (request index, first row, end row, position ending the run)."""
        runs, row = [], 0
        for index, (state, q) in enumerate(zip(states, query_lens)):
            start = state.num_computed_tokens
            for feature in state.mm_features:
                if not feature.overlaps(start, start + q):
                    continue
                for run_start, run_end in feature.runs():
                    if run_start < start + q and start < run_end:
                        lo = max(run_start, start)
                        runs.append((index, row + lo - start, row + min(run_end, start + q) - start, run_end))
            row += q
        if runs:
            for group_meta in meta.group_metadata or [meta]:
                group_meta.bidirectional_runs = runs

    def mrope_positions(self, states: list[Any], query_lens: list[int], positions: torch.Tensor) -> torch.Tensor:
        """The step's positions as an M-RoPE model takes them: [3, T] when a scheduled token is an image's (its
        grid position), else [T] (three equal rows): prompt tokens read the request's prompt table, later tokens
        their index + the request's delta. Decode steps thus stay [T], step graphs included."""
        pieces = []
        for state, q in zip(states, query_lens):
            if state.mrope is None:  # once per request: its prompt's positions from its images' grids
                state.mrope = self.model.mrope_positions(len(state.prompt_token_ids), state.mm_features)
            table, delta = state.mrope
            index = np.arange(state.num_computed_tokens, state.num_computed_tokens + q)
            rows = np.repeat((index + delta)[None, :], 3, axis=0)
            inside = index < table.shape[1]
            rows[:, inside] = table[:, index[inside]]
            pieces.append(rows)
        out = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), dtype=np.int64)
        if (out == out[:1]).all():
            out = out[0]
        return torch.from_numpy(np.ascontiguousarray(out)).to(device=positions.device, dtype=positions.dtype)

    def _encode(self, features: list[Any]) -> None:
        """Encode images not in the cache, ``ENCODER_BATCH`` at a time (the model batches what it can)."""
        for start in range(0, len(features), ENCODER_BATCH):
            batch = features[start:start + ENCODER_BATCH]
            outputs = self.model.embed_images([f.data for f in batch])
            self.num_encoder_calls += 1
            for feature, output in zip(batch, outputs):
                if output.shape[0] != feature.num_embeds:
                    raise RuntimeError(f"image {feature.identifier[:12]}: the encoder gave {output.shape[0]} "
                                       f"embeddings for {feature.num_embeds} placeholder tokens")
                self.cache[feature.identifier] = output
                self.num_encoded_images += 1
        if features:
            logger.debug("encoded %d image(s) in %d call(s); the encoder cache holds %d", len(features),
                         -(-len(features) // ENCODER_BATCH), len(self.cache))
