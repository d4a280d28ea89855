"""Physical KV blocks: reference counts, an LRU free queue and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.block_hash import BlockHash
from pagedllm.core.kv_cache_snapshot import BLOCK_CACHED, BLOCK_FREE, BLOCK_NULL, BLOCK_SHARED, BLOCK_USED
from pagedllm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVCacheBlock:
    """One physical block. ``prev_free``/``next_free`` link it into the free queue while unused."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_value", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.parent_value: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently used at the front.

    Removing a block from the middle (a prefix-cache hit on a free block) is O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not in the free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every block. Block 0 is a reserved null block (padding in block tables), never handed out.

    With ``enable_kv_cache_events`` the pool records how its set of findable hashes changes (``take_events``);
    replaying the events gives exactly ``cached``'s keys. Off, recording costs one ``is None`` test.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, KVCacheBlock] = {}  # hash value -> block
        self._events: list[KVEvent] | None = [] if enable_kv_cache_events else None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable

    def lookup(self, block_hash: BlockHash, parent_value: int) -> KVCacheBlock | None:
        """The cached block for this hash, only if its parent and tokens really match."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash or block.parent_value != parent_value:
            return None
        return block

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        """Take ``num`` blocks from the LRU end; a cached one loses its hash now (lazy eviction)."""
        if num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue.

        Callers pass a request's blocks last-first so a request's tail is evicted before its prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, parent_value: int,
                    parent_is_root: bool = False) -> None:
        """Make a full block findable. First writer wins: a duplicate stays uncached.

        ``parent_is_root``: the block is a prompt's first (its event names no parent block).
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash.value in self.cached:
            return
        block.block_hash = block_hash
        block.parent_value = parent_value
        self.cached[block_hash.value] = block
        if self._events is not None:
            self._record_stored(block_hash, None if parent_is_root else parent_value)

    def uncache(self, block: KVCacheBlock) -> None:
        """Make a block unfindable by prefix lookups (its K/V can no longer be trusted)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock, record: bool = True) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash.value) is block:
                del self.cached[block.block_hash.value]
                if record and self._events is not None:
                    self._record_removed(block.block_hash.value)
            block.block_hash = None
            block.parent_value = None

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first ([] when recording is off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def _record_stored(self, block_hash: BlockHash, parent: int | None) -> None:
        assert self._events is not None
        last = self._events[-1] if self._events else None
        # A request's consecutive blocks, cached in one call, extend one event as a chain (vLLM's shape).
        if (isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent
                and last.block_size == len(block_hash.token_ids)):
            last.block_hashes.append(block_hash.value)
            last.token_ids.extend(block_hash.token_ids)
            return
        self._events.append(BlockStored(block_hashes=[block_hash.value], parent_block_hash=parent,
                                        token_ids=list(block_hash.token_ids), block_size=len(block_hash.token_ids)))

    def _record_removed(self, value: int) -> None:
        assert self._events is not None
        if self._events and isinstance(self._events[-1], BlockRemoved):
            self._events[-1].block_hashes.append(value)
        else:
            self._events.append(BlockRemoved(block_hashes=[value]))

    def block_states(self) -> list[str]:
        """One state character per block, in id order (see ``core/kv_cache_snapshot.py``)."""
        # Inlined (no call per block): this runs over every block while someone watches the map.
        states = [(BLOCK_FREE if b.block_hash is None else BLOCK_CACHED) if b.ref_cnt == 0
                  else BLOCK_USED if b.ref_cnt == 1 else BLOCK_SHARED for b in self.blocks]
        states[0] = BLOCK_NULL
        return states

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data). Returns how many were dropped."""
        dropped = len(self.cached)
        for block in list(self.cached.values()):
            self._evict(block, record=False)  # one AllBlocksCleared says it all
        self.cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return dropped
