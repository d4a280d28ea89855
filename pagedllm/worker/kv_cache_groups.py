"""How a hybrid model's KV memory splits between its full group and its sliding-window group.

The sliding group (Gemma 3's local layers) holds per request only the blocks its window still sees, plus
the tokens of the request's latest step (a prefill chunk writes all its tokens before attending), plus
its lookahead slots (``core/kv_cache_group.py`` frees the rest): at most
``ceil((window + lookahead + step tokens) / block_size) + 1`` blocks. The step tokens of all requests
together are one step's budget, so ``max_num_seqs`` requests need about
``max_num_seqs * (ceil((window + lookahead) / block_size) + 2) + ceil(max_num_batched_tokens / block_size)``
blocks; the full group (the global layers, which keep every block) gets the rest of the budget. Should
the sliding group still run short, the scheduler preempts as it does when the full group does; one
request alone always fits.
"""

from __future__ import annotations

from pagedllm.utils import cdiv


def sliding_group_blocks_wanted(window: int, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                                num_lookahead_tokens: int = 0) -> int:
    """Blocks (null block included) the sliding group needs for ``max_num_seqs`` running requests."""
    per_request = cdiv(window + num_lookahead_tokens, block_size) + 2
    return max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size) + 1


def split_kv_budget(budget: int, full_bytes_per_block: int, sliding_bytes_per_block: int,
                    sliding_wanted: int) -> tuple[int, int]:
    """(full group blocks, sliding group blocks) that fit ``budget`` bytes: as many full blocks as possible
    with the sliding group at ``sliding_wanted`` blocks, but never more sliding than full blocks (a request
    holds no more sliding blocks than full ones, so then the sliding group is never the limit)."""
    full = (budget - sliding_wanted * sliding_bytes_per_block) // full_bytes_per_block
    if full >= sliding_wanted:
        return int(full), sliding_wanted
    both = budget // (full_bytes_per_block + sliding_bytes_per_block)
    return int(both), int(both)
