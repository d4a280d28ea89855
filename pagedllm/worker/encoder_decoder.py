"""The model runner's encoder-decoder part (Whisper): encoder runs, and the cross-attention group's metadata.

In a step that admits requests, their encoders run once, batched (``run_encoders``: ``ENCODER_BATCH`` at a time),
and each decoder layer's cross-attention K/V of the encoder output are written into the request's blocks of the
cross-attention KV cache group: positions 0..P-1 (P = 1500) through its block table there. Every step's
decoder forward then reads them: the group's metadata (``cross_metadata``) has the decoder's query layout and,
per request, its cross-attention block table and ``seq_len`` = P (``attention/backends/cross_attention.py``).

The runner learns nothing else: a preempted request comes back as a new one and its encoder runs again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.host_to_device import to_device
from pagedllm.logger import init_logger
from pagedllm.utils import cdiv

logger = init_logger(__name__)

# Encoders run this many requests at a time: bounds the activations of a burst of new audio (base: ~200 MB
# a request in float32 at the MLP), and a batch beyond a few gains nothing on a CPU.
ENCODER_BATCH = 8


class EncoderDecoderRunner:
    """``group``: the cross-attention group's index; ``positions``: encoder positions per request (P)."""

    def __init__(self, model: nn.Module, group: int, positions: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.group = group
        self.positions = positions
        self.block_size = block_size
        self.device = device
        offsets = np.arange(positions, dtype=np.int64)
        self._block_of_position, self._offset_in_block = offsets // block_size, offsets % block_size
        self.num_encoder_runs = 0  # requests whose encoder ran (a counter for tests and logs)

    def slot_mapping(self, cross_block_ids: list[int]) -> np.ndarray:
        """[P] int64 cache slot of each encoder position of a request, from its cross-attention block table."""
        if len(cross_block_ids) < cdiv(self.positions, self.block_size):
            raise RuntimeError(f"cross-attention block table holds {len(cross_block_ids)} blocks, fewer than "
                               f"{self.positions} encoder positions need")
        table = np.asarray(cross_block_ids, dtype=np.int64)
        return table[self._block_of_position] * self.block_size + self._offset_in_block

    @torch.inference_mode()
    def run_encoders(self, sched: SchedulerOutput) -> None:
        """Encode the audio of the requests new to the runner this step and store their cross-attention K/V."""
        new = [n for n in sched.scheduled_new_reqs if n.encoder_input is not None]
        for start in range(0, len(new), ENCODER_BATCH):
            batch = new[start:start + ENCODER_BATCH]
            features = to_device(torch.from_numpy(np.stack([n.encoder_input for n in batch])), self.device)
            hidden = self.model.encode(features)  # [n * P, d]
            slots = np.concatenate([self.slot_mapping(n.block_ids[self.group]) for n in batch])
            self.model.write_cross_kv(hidden, to_device(torch.from_numpy(slots), self.device))
            self.num_encoder_runs += len(batch)

    def cross_metadata(self, block_tables: list[list[int]], decoder_meta: AttentionMetadata) -> AttentionMetadata:
        """The cross-attention group's metadata for a step whose decoder metadata is ``decoder_meta``; the
        requests' cross-attention block tables in the same order. Nothing is written through it (its
        slot_mapping is the decoder's, unused)."""
        return AttentionMetadata.cross_attention(decoder_meta, block_tables, self.positions, self.block_size,
                                                 self.device)


def attach_encoder_decoder(runner: Any, positions: int) -> EncoderDecoderRunner:
    """Give ``runner`` its encoder-decoder part; the cross-attention layers are the model's KV cache group 1."""
    groups = runner.kv_cache_groups()[0]
    if 1 not in groups:
        raise ValueError(f"{type(runner.model).__name__} is an encoder-decoder model without cross-attention layers")
    runner.encoder_decoder = EncoderDecoderRunner(runner.model, 1, positions, runner.block_size, runner.device)
    return runner.encoder_decoder
