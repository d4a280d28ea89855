"""Multimodal inputs as the scheduler sees them: where each image's tokens sit in the prompt, and its content hash.
No torch here.

An image in a prompt is a span of ``length`` positions starting at ``offset`` (the model's HF processor expands
one image token into it). Every position of the span takes a row of the image's encoder output, unless
``embed_mask`` says which do: Idefics3 puts text tokens (a tile's row/column tag) between the tiles' image tokens.
The scheduler needs only the span and ``identifier`` (the image's content hash, ``multimodal/hashing.py``): the
encoder cache is keyed by it, and the prefix cache's block hashes cover it, so two prompts with identical text and
different images never share KV blocks. ``data`` (the processed pixels)
is opaque here; only the model runner reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MultiModalFeature:
    """One image of a prompt: its placeholder run ``[offset, offset + length)`` and content hash."""

    identifier: str  # the image's content hash (hex)
    offset: int  # position of its first placeholder token in the prompt
    length: int  # positions of its span
    modality: str = "image"
    data: Any = None  # the processor's output for it (pixel values ...), for the runner's encoder
    # One byte per span position, 1 where the position takes the next encoder-output row; None: all do.
    embed_mask: bytes | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Rows of its encoder output (what it costs the encoder budget and the encoder cache)."""
        return self.length if self.embed_mask is None else sum(self.embed_mask)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions ``[start, end)`` hold any of this image's tokens."""
        return self.offset < end and start < self.end

    def runs(self) -> list[tuple[int, int]]:
        """Its runs of consecutive embedded positions, ``[(start, end), ...]`` in prompt positions: the whole span,
        or each tile's where text tags sit between them."""
        if self.embed_mask is None:
            return [(self.offset, self.end)]
        runs, begin = [], None
        for i, flag in enumerate(self.embed_mask):
            if flag and begin is None:
                begin = i
            elif not flag and begin is not None:
                runs.append((self.offset + begin, self.offset + i))
                begin = None
        if begin is not None:
            runs.append((self.offset + begin, self.end))
        return runs


def end_outside_runs(features: list[MultiModalFeature], start: int, end: int) -> int:
    """The end of a chunk ``[start, end)`` moved back so that it splits no image run (models whose image tokens
    attend to each other both ways compute each run in one step): the start of the run it would split, or
    ``start`` (nothing now) when the chunk begins inside that run and cannot reach its end."""
    for feature in features:
        if feature.overlaps(start, end):
            for run_start, run_end in feature.runs():
                if run_start < end < run_end:
                    return max(run_start, start)
    return end


def multimodal_block_keys(features: list[MultiModalFeature], start: int, end: int) -> tuple:
    """Extra block-hash keys of the block of positions ``[start, end)``: the content hash of each image with tokens
    in it and where that image starts relative to the block (so the same image shifted is another block)."""
    keys: list[Any] = []
    for feature in features:
        if feature.overlaps(start, end):
            keys.extend((feature.identifier, feature.offset - start))
    return tuple(keys)


def check_images_fit(features: list[MultiModalFeature], max_num_batched_tokens: int, encoder_cache_rows: int) -> None:
    """ValueError naming the image when one could never be encoded: its tokens are encoded in one step, so they
    must fit one step's budget and the encoder cache."""
    for number, feature in enumerate(features, 1):
        if feature.num_embeds > max_num_batched_tokens:
            raise ValueError(f"{feature.modality}: image {number} takes {feature.num_embeds} tokens, more than one "
                             f"step's budget ({max_num_batched_tokens} tokens); raise --max-num-batched-tokens or "
                             "send a smaller image")
        if feature.num_embeds > encoder_cache_rows:
            raise ValueError(f"{feature.modality}: image {number} takes {feature.num_embeds} tokens, more than the "
                             f"encoder cache holds ({encoder_cache_rows}); raise --encoder-cache-size")
