"""KV cache events: what a block pool tells the outside about its prefix cache (vLLM's ``--kv-events-config``).

A router (or llm-d's scheduler) replays them to know which block hashes an engine holds: ``BlockStored``
adds hashes, ``BlockRemoved`` drops them, ``AllBlocksCleared`` drops all. Tagged msgspec structs in vLLM's
array-like layout (``["BlockStored", [hashes...], parent, [tokens...], block_size, lora_id, medium]``), so a
``KVEventBatch`` round-trips through msgpack and its union of events decodes by tag.
"""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Base of the events; the tag (the class name) comes first in the encoded array."""


class BlockStored(KVCacheEvent):
    """Blocks that became findable, a chain in order: ``block_hashes[i]`` is the parent of ``[i + 1]``.

    ``parent_block_hash`` is the hash before the first of them (None: the first is a prompt's first block).
    ``token_ids`` holds ``block_size`` tokens per block, concatenated. ``lora_id`` and ``medium`` keep the
    fields of vLLM's layout (None: a LoRA adapter is keyed in the hash itself, by its content digest; one medium).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    """Block hashes that are no longer findable (the block was reused, or its K/V stopped being trusted)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: no hash is findable any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One engine step's events, in order. ``ts``: wall-clock seconds when the batch was taken."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def replay_events(cached: set[int], events: list[KVEvent]) -> None:
    """Apply events to a set of cached hash values in place (what a consumer of the events keeps)."""
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()
