"""Where the Responses API keeps responses (``store: true``) for ``retrieve``, ``input_items`` and
``previous_response_id``.

``ResponseStore`` is the interface (async, so a Redis or database backend can implement it later: not built
yet). ``InMemoryResponseStore`` is the default: bounded by a number of responses and by bytes (the JSON size
of what is kept), least recently used dropped first, and entries older than a TTL dropped when met.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagedllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_TTL_S = 24 * 3600.0


@dataclass
class StoredResponse:
    """One response and what a continuation needs.

    ``response``: the Response object as sent (JSON-ready). ``input_items``: this request's input items, with
    ids. ``context``: every item of the conversation up to and including this response's output (earlier
    responses' items too), so ``previous_response_id`` replays all of it, function calls and outputs included.
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)

    def num_bytes(self) -> int:
        return len(json.dumps([self.response, self.input_items, self.context], separators=(",", ":")))


class ResponseStore:
    """The interface. ``put`` replaces an existing entry of the same id (a background run's updates)."""

    async def get(self, response_id: str) -> StoredResponse | None:
        raise NotImplementedError

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        """False when the record cannot be kept (larger than the store's whole byte bound)."""
        raise NotImplementedError

    async def delete(self, response_id: str) -> bool:
        raise NotImplementedError


class InMemoryResponseStore(ResponseStore):
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl_s: float = DEFAULT_TTL_S, clock: Any = time.monotonic) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl_s < 0:
            raise ValueError("responses store: max entries, max bytes and TTL must not be negative")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()  # last used last
        self._put_times: OrderedDict[str, float] = OrderedDict()  # last put last: the TTL's order
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        size = record.num_bytes()
        self._drop(response_id)
        if self.max_entries == 0 or size > self.max_bytes:
            logger.warning("response %s (%d bytes) not stored: the store keeps %d responses, %d bytes",
                           response_id, size, self.max_entries, self.max_bytes)
            return False
        self._entries[response_id] = (record, size)
        self._put_times[response_id] = self._clock()
        self.num_bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.num_evicted += 1
        return True

    async def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        del self._put_times[response_id]
        self.num_bytes -= entry[1]
        return True

    def _expire(self) -> None:
        if not self.ttl_s:
            return
        limit = self._clock() - self.ttl_s
        while self._put_times:
            response_id, put_time = next(iter(self._put_times.items()))
            if put_time >= limit:
                return
            self._drop(response_id)
