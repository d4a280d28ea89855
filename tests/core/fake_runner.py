"""A model-free runner that keeps state from scheduler diffs and 'computes' through a fake KV cache.

Each token's K/V is stood in for by the token id, written at its slot. A sampled token is a hash of the
context read back through the block table, so any block-table, prefix-cache or preemption mistake
changes the output.
"""

from __future__ import annotations

import numpy as np

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.state: dict[str, dict] = {}

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.state.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            self.state[new.req_id] = {"tokens": new.prompt_token_ids + new.output_token_ids,
                                      "blocks": list(new.block_ids), "computed": new.num_computed_tokens}
        for cached in sched.scheduled_cached_reqs:
            st = self.state[cached.req_id]
            st["blocks"].extend(cached.new_block_ids)
            assert st["computed"] == cached.num_computed_tokens
        out = ModelRunnerOutput(sampled_token_ids={})
        bs = self.block_size
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.state[rid]
            start = st["computed"]
            assert len(st["blocks"]) * bs >= start + n, "not enough blocks for the scheduled tokens"
            for pos in range(start, start + n):
                self.kv[st["blocks"][pos // bs] * bs + pos % bs] = st["tokens"][pos]
            st["computed"] = start + n
            if st["computed"] == len(st["tokens"]):
                context = [int(self.kv[st["blocks"][p // bs] * bs + p % bs]) for p in range(st["computed"])]
                token = next_token(context)
                st["tokens"].append(token)
                out.sampled_token_ids[rid] = token
        return out


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
