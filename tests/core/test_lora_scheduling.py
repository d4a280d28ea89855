"""LoRA in the torch-free core: the scheduler never runs more distinct adapters than the worker has slots (the
others wait, none is dropped), and the prefix cache keys blocks by adapter content (``Request.block_keys``)."""

from __future__ import annotations

import dataclasses

from pagedllm.core.block_hash import compute_block_hash_values, hash_block
from pagedllm.lora.request import AdapterRef

from helpers.scheduler import make_request, make_scheduler, run_to_completion


def _adapter(name: str, digest: str) -> AdapterRef:
    return AdapterRef(name, 1, f"/adapters/{name}", digest)


def _with_lora(request, ref):
    request.lora = ref
    return request


def _scheduler(max_loras: int):
    sched = make_scheduler(max_seqs=16, budget=64)
    sched.config = dataclasses.replace(sched.config, max_loras=max_loras)
    return sched


def test_running_adapters_never_exceed_the_slots_and_every_request_finishes() -> None:
    sched = _scheduler(max_loras=2)
    adapters = [_adapter(f"a{i}", f"d{i}") for i in range(5)]
    requests = [_with_lora(make_request(f"r{i}", [1, 2, 3, i], 6), adapters[i % 5] if i % 6 else None)
                for i in range(12)]
    peak = []
    original = sched.schedule

    def schedule():
        out = original()
        peak.append(len({r.lora_key for r in sched.running if r.lora_key}))
        return out

    sched.schedule = schedule
    outputs, _ = run_to_completion(sched, {0: requests})
    assert max(peak) == 2
    assert sorted(outputs) == sorted(r.request_id for r in requests)
    assert all(len(tokens) == 6 for tokens in outputs.values())


def test_waiting_adapters_keep_their_order_and_base_requests_pass() -> None:
    sched = _scheduler(max_loras=1)
    a, b = _adapter("a", "da"), _adapter("b", "db")
    for request in (_with_lora(make_request("ra", [1, 2], 4), a), _with_lora(make_request("rb", [3, 4], 4), b),
                    make_request("base", [5, 6], 4), _with_lora(make_request("ra2", [7, 8], 4), a)):
        sched.add_request(request)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"ra", "base", "ra2"}  # b waits for the slot
    assert [r.request_id for r in sched.waiting] == ["rb"]


def test_blocks_are_keyed_by_adapter_content_not_name() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(1, 14))
    first = _with_lora(make_request("x", prompt, 1), _adapter("same-name", "digest-1"))
    sched.add_request(first)
    run_to_completion(sched)
    cases = [(None, 0), (_adapter("same-name", "digest-2"), 0), (_adapter("other-name", "digest-1"), 12)]
    for i, (ref, hit_tokens) in enumerate(cases):
        request = _with_lora(make_request(f"y{i}", prompt, 1), ref)
        assert sched.kv.get_computed_blocks(request)[1] == hit_tokens


def test_router_hashes_with_the_request_keys_equal_the_engine_ones() -> None:
    request = _with_lora(make_request("x", list(range(1, 10)), 1), _adapter("a", "d"))
    plain = compute_block_hash_values(request.all_token_ids, 4, 7, "sha256", None)
    keyed = compute_block_hash_values(request.all_token_ids, 4, 7, "sha256", None, request.block_keys)
    assert plain != keyed
    assert keyed[0] == hash_block(7, (1, 2, 3, 4), ("lora:d",), "sha256").value
