"""The in-memory response store: bounded by count and bytes (least recently used out first), a TTL, replace
on re-put, and items translated to chat messages (function calls and their outputs kept in order)."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.entrypoints.openai.protocol_responses import messages_from_items
from pagedllm.entrypoints.openai.response_store import InMemoryResponseStore, StoredResponse


def record(text: str = "x") -> StoredResponse:
    return StoredResponse({"id": "r", "text": text}, [], [])


def run(coro):
    return asyncio.run(coro)


def test_count_bound_drops_the_least_recently_used() -> None:
    store = InMemoryResponseStore(max_entries=2)
    run(store.put("a", record()))
    run(store.put("b", record()))
    assert run(store.get("a")) is not None  # a is now more recent than b
    run(store.put("c", record()))
    assert run(store.get("b")) is None and run(store.get("a")) and run(store.get("c"))
    assert len(store) == 2 and store.num_evicted == 1


def test_byte_bound_and_accounting() -> None:
    size = record("y" * 100).num_bytes()
    store = InMemoryResponseStore(max_bytes=2 * size + 10)
    for key in "abc":
        run(store.put(key, record("y" * 100)))
    assert len(store) == 2 and store.num_bytes == 2 * size and run(store.get("a")) is None
    run(store.put("b", record("z")))  # a re-put replaces, and its bytes are recounted
    assert store.num_bytes == size + record("z").num_bytes()
    assert run(store.delete("b")) and not run(store.delete("b")) and store.num_bytes == size
    assert not run(store.put("huge", record("h" * 10 * size))) and run(store.get("huge")) is None


def test_ttl_with_a_clock() -> None:
    now = [0.0]
    store = InMemoryResponseStore(ttl_s=10, clock=lambda: now[0])
    run(store.put("a", record()))
    now[0] = 5
    run(store.put("b", record()))
    assert run(store.get("a")) is not None  # reading does not renew the TTL
    now[0] = 11
    assert run(store.get("a")) is None and run(store.get("b")) is not None
    now[0] = 16
    assert run(store.get("b")) is None and len(store) == 0 and store.num_bytes == 0


def test_zero_entries_stores_nothing_and_negative_bounds_fail() -> None:
    store = InMemoryResponseStore(max_entries=0)
    assert not run(store.put("a", record())) and run(store.get("a")) is None
    with pytest.raises(ValueError):
        InMemoryResponseStore(max_bytes=-1)


def test_items_to_messages_keep_calls_and_outputs() -> None:
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sun"},
             {"type": "function_call_output", "call_id": "c2", "output": "rain"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Mixed."}]}]
    messages = messages_from_items(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sun"}
    assert messages[-1]["content"] == "Mixed."
    with pytest.raises(ValueError, match=r"input.0.call_id"):
        messages_from_items([{"type": "function_call_output", "call_id": "nope", "output": "x"}])
