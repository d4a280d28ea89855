"""Where the Responses API keeps responses (``store: true``) for ``retrieve``, ``input_items`` and
``previous_response_id``.

``ResponseStore`` is the interface (async, so a Redis or database backend can implement it later: not built
yet). ``InMemoryResponseStore`` is the default: bounded by a number of responses and by bytes, least recently used
dropped first, and entries older than a TTL dropped when met. It keeps each response as its compact JSON bytes, so
the byte bound is the memory it holds (Python dicts of the same responses take about 1.7x their JSON size).
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
        return len(self.to_json())

    def to_json(self) -> bytes:
        return json.dumps([self.response, self.input_items, self.context], separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        response, input_items, context = json.loads(data)
        return cls(response, input_items, context)


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
        self._entries: OrderedDict[str, bytes] = OrderedDict()  # compact JSON of each record, last used last
        self._put_times: OrderedDict[str, float] = OrderedDict()  # last put last: the TTL's order
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        data = self._entries.get(response_id)
        if data is None:
            return None
        self._entries.move_to_end(response_id)
        return StoredResponse.from_json(data)  # a fresh copy: callers cannot change what is kept

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        data = record.to_json()
        size = len(data)
        self._drop(response_id)
        if self.max_entries == 0 or size > self.max_bytes:
            logger.warning("response %s (%d bytes) not stored: the store keeps %d responses, %d bytes",
                           response_id, size, self.max_entries, self.max_bytes)
            return False
        self._entries[response_id] = data
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
        data = self._entries.pop(response_id, None)
        if data is None:
            return False
        del self._put_times[response_id]
        self.num_bytes -= len(data)
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
