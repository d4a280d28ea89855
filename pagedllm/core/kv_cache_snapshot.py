"""A point-in-time picture of the KV cache's blocks (state and owning request), for the cache map.

Built on the engine thread from the block pool and the per-request block tables; immutable once built,
so the HTTP side can read it without locks. Run-length encoded because caches have tens of thousands of
blocks and most of them sit in long runs of one state (free, or one request's table).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# One character per block state.
BLOCK_NULL = "n"  # block 0: the reserved padding block, never handed out
BLOCK_FREE = "f"  # in the free queue, holds nothing reusable
BLOCK_CACHED = "c"  # in the free queue but still findable by a prefix-cache hit
BLOCK_USED = "u"  # held by exactly one request
BLOCK_SHARED = "s"  # held by several requests (prefix-cache hits, or n > 1 children)

NO_OWNER = -1


@dataclass(frozen=True)
class KVCacheSnapshot:
    """Blocks in id order as runs ``(state, owner index or -1, count)``; ``owners`` are request ids.

    A shared block's owner is the first request (in admission order) whose block table holds it.
    """

    num_blocks: int
    block_size: int
    runs: tuple[tuple[str, int, int], ...]
    owners: tuple[str, ...]
    owner_num_blocks: tuple[int, ...]

    def states(self) -> str:
        """One state character per block (decodes the runs)."""
        return "".join(state * count for state, _, count in self.runs)

    def block_owners(self) -> list[int]:
        """Owner index per block (``NO_OWNER`` for unowned blocks)."""
        out: list[int] = []
        for _, owner, count in self.runs:
            out.extend([owner] * count)
        return out

    def count(self, state: str) -> int:
        return sum(count for s, _, count in self.runs if s == state)


def build_snapshot(states: Sequence[str], block_size: int,
                   block_tables: Mapping[str, Sequence[int]]) -> KVCacheSnapshot:
    """``states``: one state character per block; ``block_tables``: request id -> block ids it holds."""
    owner_of = [NO_OWNER] * len(states)
    owners: list[str] = []
    owner_num_blocks: list[int] = []
    for request_id, block_ids in block_tables.items():
        # A table may hold the null block in place of blocks already freed (sliding windows): not owned.
        held = [b for b in block_ids if states[b] != BLOCK_NULL]
        if not held:
            continue
        index = len(owners)
        owners.append(request_id)
        owner_num_blocks.append(len(held))
        for block_id in held:
            if owner_of[block_id] == NO_OWNER:
                owner_of[block_id] = index
    return KVCacheSnapshot(len(states), block_size, _runs(states, owner_of), tuple(owners),
                           tuple(owner_num_blocks))


def _runs(states: Sequence[str], owner_of: Sequence[int]) -> tuple[tuple[str, int, int], ...]:
    runs: list[tuple[str, int, int]] = []
    prev: tuple[str, int] | None = None
    start = 0
    for i, key in enumerate(zip(states, owner_of)):
        if key != prev:
            if prev is not None:
                runs.append((prev[0], prev[1], i - start))
            prev, start = key, i
    if prev is not None:
        runs.append((prev[0], prev[1], len(states) - start))
    return tuple(runs)
