"""Per-request block tables (one per KV cache group) on top of the block pools, with automatic prefix caching."""

from __future__ import annotations

from pagedllm.core.block_hash import BlockHash, check_hash_algo, extend_block_hashes, root_hash_value
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_group import KVCacheGroup
from pagedllm.core.kv_cache_snapshot import KVCacheSnapshot, build_snapshot
from pagedllm.core.kv_events import KVEvent
from pagedllm.core.request import Request
from pagedllm.utils import cdiv

# One list of blocks per KV cache group, in group order.
GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheManager:
    """Allocates blocks for requests; the scheduler only sees opaque results (blocks or None).

    Every operation runs over the KV cache groups (``core/kv_cache_group.py``): one for most models; a
    hybrid model's sliding-window layers get a second one (``sliding_group``: its blocks and window), whose
    blocks out of the window are freed while the full group keeps the whole context; an encoder-decoder model's
    cross-attention layers get theirs (``cross_group``: its blocks, and encoder positions per request). Group 0
    is the one usage, admission, the cache map and the KV cache events follow.

    Block hashes come from ``core/block_hash.py`` (``hash_algo``: builtin | sha256, the root from
    ``hash_seed``), the same functions a router uses to predict them. ``enable_kv_cache_events``: group 0's
    pool records BlockStored / BlockRemoved / AllBlocksCleared for ``take_events``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_seed: int | None = None, sliding_window: int | None = None,
                 sliding_group: tuple[int, int] | None = None, hash_algo: str = "builtin",
                 enable_kv_cache_events: bool = False, cross_group: tuple[int, int] | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = check_hash_algo(hash_algo)
        # sliding_window: every attention layer slides with it (one group, Mistral-style).
        self.groups = [KVCacheGroup(num_blocks, block_size, enable_caching, sliding_window,
                                    enable_kv_cache_events=enable_kv_cache_events)]
        if sliding_group is not None:  # (num_blocks, window) of a hybrid model's sliding layers
            self.groups.append(KVCacheGroup(sliding_group[0], block_size, enable_caching, sliding_group[1]))
        if cross_group is not None:  # (num_blocks, encoder positions) of an encoder-decoder model's cross-attention
            if enable_caching:
                raise ValueError("enable_prefix_caching: an encoder-decoder model runs without prefix caching")
            self.groups.append(KVCacheGroup(cross_group[0], block_size, False, encoder_tokens=cross_group[1]))
        # The first block's parent value: random per process unless configured, so hashes can't be
        # predicted across deployments.
        self.root_hash = root_hash_value(hash_seed, hash_algo)
        # Prefix-cache statistics, counted in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # Group 0's state, under the names callers used before there were groups (tests read them; the product
    # code reads ``groups[0]``).
    @property
    def pool(self) -> BlockPool:
        return self.groups[0].pool

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return self.groups[0].req_to_blocks

    @property
    def sliding_window(self) -> int | None:
        return self.groups[0].sliding_window

    @property
    def usage(self) -> float:
        return self.groups[0].pool.usage

    @property
    def num_usable_blocks(self) -> int:
        return self.groups[0].num_usable_blocks

    @property
    def sliding_group_usage(self) -> float | None:
        """Usage of a hybrid model's sliding-window group (``usage`` is the full group's); None with one group."""
        return self.groups[1].pool.usage if len(self.groups) > 1 else None

    def _parent_value(self, request: Request, index: int) -> int:
        return self.root_hash if index == 0 else request.block_hashes[index - 1].value

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained block hashes to cover all its full blocks."""
        # Checked here first: most calls (decode steps) have no newly filled block.
        if (len(request.block_hashes) + 1) * self.block_size <= request.num_tokens:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self.root_hash,
                                self.hash_algo, request.cache_salt, request.block_extra_keys)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Cached full blocks a new request may start from (one list per group), and the tokens they cover.

        The hit is the longest that every group can serve: a full group needs each block of it cached, a
        sliding group only the blocks its window still sees. The last token is always left to compute: its
        logits are needed to sample.
        """
        empty = tuple([] for _ in self.groups)
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return empty, 0  # prompt logprobs need the logits of every prompt position
        self._update_block_hashes(request)
        limit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        keys = [(request.block_hashes[i], self._parent_value(request, i)) for i in range(limit)]
        found = [g.lookup(keys) for g in self.groups]
        num_hit = limit
        while True:  # a smaller hit can fail a sliding group's test, so shrink until every group agrees
            shrunk = min(g.longest_hit(f, num_hit) for g, f in zip(self.groups, found))
            if shrunk == num_hit:
                break
            num_hit = shrunk
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit * self.block_size
        return tuple(g.hit_blocks(f, num_hit) for g, f in zip(self.groups, found)), num_hit * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: GroupBlocks | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0, cache: bool = True) -> GroupBlocks | None:
        """Make room for ``num_new_tokens`` more tokens (after any prefix hits) in every group: the new
        blocks per group, or None (and nothing taken) if one group can't.

        ``num_lookahead_tokens`` more slots are reserved past them (a draft model writes its proposals'
        K/V there); they are never hashed for the prefix cache. ``cache=False``: the new blocks are not entered in
        the prefix cache now (a connector fills them later; the next allocation enters them).
        """
        rid = request.request_id
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if not new_computed_blocks and len(self.groups) == 1 and self.groups[0].sliding_window is None:
            # Most calls of a decode step: the request's blocks already hold the new tokens. Nothing to take
            # from the pool; only a block that just filled is hashed and cached (every 16th token).
            group = self.groups[0]
            held = group.req_to_blocks.get(rid)
            if held is not None and total_tokens + num_lookahead_tokens <= len(held) * self.block_size:
                if self.enable_caching and total_tokens // self.block_size > group.num_cached_blocks.get(rid, 0):
                    self._cache_full_blocks(request, total_tokens)
                return ([],)
        hits = new_computed_blocks or tuple([] for _ in self.groups)
        for group in self.groups:
            group.free_outside_window(rid, request.num_computed_tokens)
        needed = [g.num_new_blocks(rid, total_tokens + num_lookahead_tokens, h) for g, h in zip(self.groups, hits)]
        if not all(g.can_allocate(n, h) for g, n, h in zip(self.groups, needed, hits)):
            return None
        new_blocks = tuple(g.allocate(rid, n, h) for g, n, h in zip(self.groups, needed, hits))
        if self.enable_caching and cache:
            self._cache_full_blocks(request, total_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # K/V of these tokens is written during the coming step, before any later step can read it,
        # and within a step every layer writes the whole batch's K/V before attending.
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        rid = request.request_id
        for group in self.groups:
            blocks, null = group.req_to_blocks[rid], group.pool.null_block
            start = group.num_cached_blocks.get(rid, 0)
            for i in range(start, num_full):
                if blocks[i] is not null:  # a sliding group's block already out of the window
                    group.pool.cache_block(blocks[i], request.block_hashes[i], self._parent_value(request, i),
                                           parent_is_root=i == 0)
            group.num_cached_blocks[rid] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks in every group."""
        for group in self.groups:
            group.free(request.request_id)

    def uncache_from(self, request: Request, num_valid_tokens: int) -> None:
        """Forget the prefix-cache entries of the request's blocks past its first ``num_valid_tokens``
        tokens: after a failed step their K/V may be half-written."""
        for group in self.groups:
            group.uncache_from(request.request_id, num_valid_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group (null block 0 where a sliding group freed one)."""
        return tuple([b.block_id for b in g.req_to_blocks.get(request_id, [])] for g in self.groups)

    def reset_prefix_cache(self) -> int:
        return sum(g.pool.reset_prefix_cache() for g in self.groups)

    def take_events(self) -> list[KVEvent]:
        """Group 0's KV cache events since the last call, oldest first; [] unless events are enabled."""
        return self.groups[0].pool.take_events()

    def snapshot(self) -> KVCacheSnapshot:
        """Every block's state and owning request in group 0, for the playground's cache map. O(num_blocks)."""
        group = self.groups[0]
        tables = {rid: [b.block_id for b in blocks] for rid, blocks in group.req_to_blocks.items()}
        return build_snapshot(group.pool.block_states(), self.block_size, tables)

    def can_ever_fit(self, num_tokens: int) -> bool:
        # A sliding group is sized to hold any request group 0 admits (worker/kv_cache_groups.py).
        return cdiv(num_tokens, self.block_size) <= self.num_usable_blocks


__all__ = ["BlockHash", "KVCacheManager"]
