"""The scheduler's side of the KV connector seam (``distributed/kv_transfer/base.py``). No torch here.

Three things the scheduler cannot decide alone, kept in one place:
- **matched tokens**: after the local prefix cache, the connector may provide more of a prompt; synchronously
  (loaded in the step that computes the rest) or asynchronously (the request waits in
  ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated, others run meanwhile);
- **held blocks**: a finished request whose blocks a remote reader still needs (a producer), or whose blocks
  may still be written (a consumer aborted mid-transfer) keeps them until the worker half reports it done;
  nothing else frees them, and the worker half reports every held request eventually (read, timed out,
  cancelled), so no block leaks;
- **where prompt tokens came from** (``prompt_tokens_by_source``: vLLM's ``local_compute``,
  ``local_cache_hit``, ``external_kv_transfer``) and how many transfers failed and were recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.logger import init_logger

if TYPE_CHECKING:
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorOutput

logger = init_logger(__name__)

PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def count_prompt_sources(counts: dict[str, int], request: Request) -> None:
    """At a request's first admission: add its prompt tokens by source to ``counts``."""
    external = request.num_external_computed_tokens
    hit = request.num_computed_tokens - external
    counts["local_cache_hit"] += hit
    counts["external_kv_transfer"] += external
    counts["local_compute"] += request.num_prompt_tokens - hit - external


class RemoteKVState:
    def __init__(self, connector: KVConnectorBase_V1, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.held: dict[str, Request] = {}  # finished requests whose blocks the connector still needs
        self.receiving: dict[str, int] = {}  # WAITING_FOR_REMOTE_KVS: request id -> tokens expected
        self._arrived: set[str] = set()
        self._failed: set[str] = set()
        self.num_failed_transfers = 0  # receives that failed; their prompts were recomputed locally

    @property
    def has_pending(self) -> bool:
        return bool(self.held or self.receiving)

    def matched_tokens(self, request: Request, num_hit_tokens: int) -> tuple[int, bool]:
        """Tokens past the local hit the connector provides (capped so at least the last prompt token is
        computed here: its logits are needed), and whether they arrive asynchronously."""
        if request.kv_transfer_failed:
            return 0, False
        num, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if not num:
            return 0, False
        if load_async:
            # Blocks for the whole prompt; the last token is recomputed once the KV is in.
            return min(num, request.num_tokens - num_hit_tokens), True
        return max(0, min(num, request.num_tokens - 1 - num_hit_tokens)), False

    def start_receiving(self, request: Request, num_tokens: int) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.receiving[request.request_id] = num_tokens

    def ready(self, request: Request) -> bool:
        """For a WAITING_FOR_REMOTE_KVS request: True once it may be scheduled (its KV arrived, or the transfer
        failed and it recomputes its prompt from the local prefix cache)."""
        rid = request.request_id
        if rid in self._failed:
            self._failed.discard(rid)
            self.receiving.pop(rid, None)
            self.num_failed_transfers += 1
            logger.warning("request %s: receiving its KV blocks failed; recomputing its prompt locally", rid)
            self.kv.free(request)  # the blocks may hold partial data; none of them was cached
            request.kv_transfer_failed = True
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            return True
        if rid not in self._arrived:
            return False
        self._arrived.discard(rid)
        loaded = self.receiving.pop(rid)
        # Everything but the last prompt token counts as computed; that one is computed again for its logits.
        request.num_computed_tokens = min(request.num_computed_tokens + loaded, request.num_tokens - 1)
        request.num_external_computed_tokens = request.num_computed_tokens - request.num_local_hit_tokens
        request.status = RequestStatus.WAITING
        return True

    def on_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The connector's say on a finished request: hold its blocks? (then kept in ``held``), and the
        ``kv_transfer_params`` for the client."""
        rid = request.request_id
        self.receiving.pop(rid, None)
        self._arrived.discard(rid)
        self._failed.discard(rid)
        block_ids = self.kv.get_block_ids(rid)[0]
        hold, params = self.connector.request_finished(request, block_ids)
        if hold and block_ids:
            self.held[rid] = request
        return hold and bool(block_ids), params

    def update(self, output: KVConnectorOutput | None) -> None:
        """Apply the worker half's report: free held blocks that are done, note arrivals and failures."""
        if output is None:
            return
        for rid in output.finished_sending | output.finished_recving:
            request = self.held.pop(rid, None)
            if request is not None:
                self.kv.free(request)
        for rid in output.finished_recving:
            if rid in self.receiving:
                self._arrived.add(rid)
        for rid in output.failed_recving:
            request = self.held.pop(rid, None)
            if request is not None:
                self.kv.free(request)
            elif rid in self.receiving:
                self._failed.add(rid)
