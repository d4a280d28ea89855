"""A model-free KV connector for the scheduler's tests: both halves over the fake runner's KV array.

A "remote" instance is a dict of prompts by request id: a consumer request whose ``kv_transfer_params`` say
``do_remote_prefill`` gets its prompt's tokens written into its allocated blocks (the fake runner's stand-in for
K/V) by the worker half, ``delay`` steps after the scheduler asked (an async load), or at the start of the step
(``sync=True``). A producer's finished request with ``do_remote_decode`` is held until ``read(req_id)`` or until
``timeout_steps`` steps passed. ``fail`` makes receives fail (the scheduler must recompute the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    kv_transfer_params,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig


@dataclass
class FakeMeta(KVConnectorMetadata):
    loads: dict[str, tuple[list[int], int, int]] = field(default_factory=dict)  # rid -> (blocks, start, count)
    sends: list[str] = field(default_factory=list)


class FakeConnector(KVConnectorBase_V1):
    def __init__(self, runner, block_size: int, delay: int = 2, sync: bool = False, fail: bool = False,
                 timeout_steps: int = 1000) -> None:
        super().__init__(KVTransferConfig("SharedStorageConnector"), KVConnectorRole.SCHEDULER, block_size)
        self.runner = runner  # the FakeRunner whose kv array stands in for the cache
        self.delay, self.sync, self.fail, self.timeout_steps = delay, sync, fail, timeout_steps
        self._pending_loads: dict[str, tuple[list[int], int, int]] = {}
        self._in_flight: dict[str, list] = {}  # rid -> [steps left, blocks, start, count, prompt]
        self._sending: dict[str, int] = {}  # rid -> steps held
        self._read: set[str] = set()
        self.prompts: dict[str, list[int]] = {}
        self.num_loaded_tokens = 0

    # ---- scheduler half -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = kv_transfer_params(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        self.prompts[request.request_id] = list(request.prompt_token_ids)
        return request.num_prompt_tokens - num_computed_tokens, not self.sync

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        start = request.num_computed_tokens if not self.sync else None
        if start is None:  # sync: the scheduler has not set num_computed_tokens yet; hits come first
            start = request.num_local_hit_tokens
        self._pending_loads[request.request_id] = (list(block_ids), start, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FakeMeta:
        meta = FakeMeta(loads=self._pending_loads)
        self._pending_loads = {}
        return meta

    def request_finished(self, request, block_ids):
        params = kv_transfer_params(request) or {}
        if params.get("do_remote_decode"):
            self._sending[request.request_id] = 0
            return True, {"do_remote_prefill": True, "remote_block_ids": list(block_ids)}
        if request.request_id in self._in_flight:  # aborted while its blocks arrive: keep them until done
            return True, None
        return False, None

    # ---- worker half ----------------------------------------------------------------------------------
    def start_load_kv(self, forward_context=None):
        meta = self._metadata
        for rid, (blocks, start, count) in (meta.loads if meta else {}).items():
            if self.sync:
                self._write(blocks, start, count, self.prompts[rid])
            else:
                self._in_flight[rid] = [self.delay, blocks, start, count, self.prompts[rid]]

    def _write(self, blocks, start, count, prompt):
        bs = self.block_size
        for pos in range(start, start + count):
            self.runner.kv[blocks[pos // bs] * bs + pos % bs] = prompt[pos]
        self.num_loaded_tokens += count

    def read(self, rid: str) -> None:
        self._read.add(rid)

    def get_finished(self, finished_req_ids):
        out = KVConnectorOutput()
        for rid, item in list(self._in_flight.items()):
            item[0] -= 1
            if item[0] > 0:
                continue
            del self._in_flight[rid]
            if self.fail:
                out.failed_recving.add(rid)
            else:
                self._write(*item[1:])
                out.finished_recving.add(rid)
        for rid in list(self._sending):
            self._sending[rid] += 1
            if rid in self._read or self._sending[rid] >= self.timeout_steps:
                del self._sending[rid]
                out.finished_sending.add(rid)
        return out


def step_with_connector(sched, runner, connector) -> list:
    """One engine step the way the model runner brackets it: load, run, report."""
    out = sched.schedule()
    connector.bind_connector_metadata(out.kv_connector_metadata)
    connector.start_load_kv()
    result = runner.execute(out)
    result.kv_connector_output = connector.get_finished(out.finished_req_ids)
    connector.clear_connector_metadata()
    return sched.update_from_output(out, result)
