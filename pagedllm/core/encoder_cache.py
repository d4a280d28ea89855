"""The scheduler's ledger of the encoder cache: which images' encoder outputs the model runner holds. No torch.

The runner keeps each image's encoder output (rows = its placeholder tokens) keyed by the image's content hash,
so an image is encoded once however its prompt is split into chunks, however often its request is preempted, and
however many requests send it. The scheduler owns the bound: ``capacity`` rows in all. An entry is *in use*
while some running request still has tokens of that image to compute; once none has, it stays cached (another
request may send the same image) but may be evicted, oldest unused first, to make room for a new image. Evicted
hashes go to the runner in the next ``SchedulerOutput`` (``free_encoder_hashes``), before it encodes new ones.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    """``capacity``: encoder-output rows (image tokens) the runner may hold at once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_free = capacity  # rows held by no entry
        self.entries: dict[str, int] = {}  # content hash -> rows
        self.users: dict[str, set[str]] = {}  # content hash -> requests that still need it
        self.unused: OrderedDict[str, int] = OrderedDict()  # cached, needed by nobody: evictable, oldest first
        self.num_unused_rows = 0
        self._freed: list[str] = []  # evicted since the runner was last told
        self.num_allocations = 0  # images the runner was asked to encode (stats, tests)

    def has(self, identifier: str) -> bool:
        return identifier in self.entries

    def can_allocate(self, rows: int) -> bool:
        """Whether ``rows`` more rows fit, evicting unused entries if needed."""
        return rows <= self.num_free + self.num_unused_rows

    def use(self, identifier: str, request_id: str) -> None:
        """``request_id`` needs the cached entry ``identifier`` (it is no longer evictable)."""
        if identifier in self.unused:
            self.num_unused_rows -= self.unused.pop(identifier)
        self.users.setdefault(identifier, set()).add(request_id)

    def allocate(self, identifier: str, rows: int, request_id: str) -> None:
        """Room for a new entry (the runner encodes it this step), evicting unused entries oldest first."""
        if not self.can_allocate(rows):
            raise RuntimeError(f"encoder cache: {rows} rows do not fit ({self.num_free} free of {self.capacity})")
        while self.num_free < rows:
            old, old_rows = self.unused.popitem(last=False)
            self.num_unused_rows -= old_rows
            self.num_free += old_rows
            del self.entries[old]
            self.users.pop(old, None)
            self._freed.append(old)
        self.entries[identifier] = rows
        self.num_free -= rows
        self.num_allocations += 1
        self.use(identifier, request_id)

    def release(self, identifier: str, request_id: str) -> None:
        """``request_id`` no longer needs ``identifier``; with no user left it becomes evictable."""
        users = self.users.get(identifier)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users and identifier in self.entries:
            del self.users[identifier]
            self.unused[identifier] = self.entries[identifier]
            self.num_unused_rows += self.entries[identifier]

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call (the runner drops their outputs)."""
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        """Evict every unused entry (``reset_prefix_cache``)."""
        for identifier, rows in self.unused.items():
            del self.entries[identifier]
            self.num_free += rows
            self._freed.append(identifier)
        self.unused.clear()
        self.num_unused_rows = 0
