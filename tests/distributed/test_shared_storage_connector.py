"""SharedStorageConnector without a model: a producer's full prompt blocks land in the directory once, a consumer
in another "process" (fresh connector objects) finds the next blocks past its local hit and loads them whole into
its own block ids; a bad file fails the load and is removed; MultiConnector chains it behind another connector."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.core.request import Request
from pagedllm.core.sched_output import NewRequestData, SchedulerOutput
from pagedllm.distributed.kv_transfer.base import KVConnectorRole
from pagedllm.distributed.kv_transfer.config import parse_kv_transfer_config
from pagedllm.distributed.kv_transfer.multi import MultiConnector
from pagedllm.distributed.kv_transfer.shared_storage import KVLoadError, SharedStorageConnector
from pagedllm.sampling_params import SamplingParams

BS, BLOCKS, LAYERS = 4, 16, 2
PROMPT = list(range(50, 61))  # 11 tokens: 2 full blocks + 3 tokens


def _pair(path: str, role: str) -> tuple[SharedStorageConnector, SharedStorageConnector, list[torch.Tensor]]:
    cfg = parse_kv_transfer_config({"kv_connector": "SharedStorageConnector", "kv_role": role,
                                    "kv_connector_extra_config": {"shared_storage_path": path}})
    sched = SharedStorageConnector(cfg, KVConnectorRole.SCHEDULER, BS)
    worker = SharedStorageConnector(cfg, KVConnectorRole.WORKER, BS)
    caches = [torch.zeros(2, BLOCKS, BS, 2, 3) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    return sched, worker, caches


def _request(rid: str, salt: str | None = None) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=2), [], 2, cache_salt=salt)


def _step(worker, meta) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.clear_connector_metadata()


def _produce(path: str) -> list[torch.Tensor]:
    sched, worker, caches = _pair(path, "kv_producer")
    for c in caches:
        c.copy_(torch.randn_like(c))
    req = _request("p")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer loads nothing
    new = NewRequestData("p", PROMPT, [], req.sampling_params, ([5, 6, 7],), 0)
    out = SchedulerOutput([new], [], {"p": len(PROMPT)}, len(PROMPT))
    meta = sched.build_connector_meta(out)
    assert [b for b, _ in meta.saves] == [5, 6]  # full blocks only
    _step(worker, meta)
    again = SchedulerOutput([], [], {}, 0)
    assert sched.build_connector_meta(again).saves == []  # saved once
    return caches


def test_blocks_saved_by_one_instance_load_into_another(tmp_path) -> None:
    produced = _produce(str(tmp_path))
    assert len(os.listdir(tmp_path)) == 2
    sched, worker, caches = _pair(str(tmp_path), "kv_consumer")
    req = _request("d")
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)
    assert sched.get_num_new_matched_tokens(req, 4) == (4, False)  # past a one-block local hit
    req.num_local_hit_tokens = 0
    sched.update_state_after_alloc(req, [9, 2, 11], 8)
    meta = sched.build_connector_meta(SchedulerOutput([], [], {}, 0))
    _step(worker, meta)
    for src, dst in zip(produced, caches):
        assert torch.equal(dst[:, [9, 2]], src[:, [5, 6]])
        assert not dst[:, 11].any()
    # Another salt is another prompt as far as the store goes.
    assert sched.get_num_new_matched_tokens(_request("s", salt="x"), 0) == (0, False)


def test_a_bad_file_fails_the_load_and_is_removed(tmp_path) -> None:
    _produce(str(tmp_path))
    sched, worker, _ = _pair(str(tmp_path), "kv_consumer")
    req = _request("d")
    sched.get_num_new_matched_tokens(req, 0)
    for name in os.listdir(tmp_path):
        (tmp_path / name).write_bytes(b"garbage")
    req.num_local_hit_tokens = 0
    sched.update_state_after_alloc(req, [1, 2, 3], 8)
    with pytest.raises(KVLoadError):
        _step(worker, sched.build_connector_meta(SchedulerOutput([], [], {}, 0)))
    assert len(os.listdir(tmp_path)) == 1  # the one it tried is gone; the next attempt matches less


def test_multi_connector_takes_the_first_that_matches(tmp_path) -> None:
    _produce(str(tmp_path / "b"))
    cfg = parse_kv_transfer_config({"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
                                    "kv_connector_extra_config": {"connectors": [
                                        {"kv_connector": "SharedStorageConnector",
                                         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "a")}},
                                        {"kv_connector": "SharedStorageConnector",
                                         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "b")}},
                                    ]}})
    sched = MultiConnector(cfg, KVConnectorRole.SCHEDULER, BS)
    worker = MultiConnector(cfg, KVConnectorRole.WORKER, BS)
    caches = [torch.zeros(2, BLOCKS, BS, 2, 3) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    sched.bind_worker(worker)
    req = _request("d")
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)  # the empty first tier offers nothing
    req.num_local_hit_tokens = 0
    sched.update_state_after_alloc(req, [1, 2, 3], 8)
    meta = sched.build_connector_meta(SchedulerOutput([], [], {}, 0))
    assert [len(m.loads) for m in meta.metadata] == [0, 2]
    _step(worker, meta)
    assert caches[0][:, [1, 2]].any()
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)
