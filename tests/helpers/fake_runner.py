"""A model-free runner that keeps state from scheduler diffs and 'computes' through a fake KV cache.

Each token's K/V is stood in for by the token id, written at its slot. A sampled token is a hash of the
context read back through the block table, so any block-table, prefix-cache or preemption mistake
changes the output.

With ``draft_error_rate`` set it also speculates: after each sampled token it proposes up to
``num_drafts`` drafts (the true continuation, each token corrupted with that probability), and verifies
scheduled drafts the way a real runner does: their K/V is written, the true token at each position is
read back from the fake cache, and drafts are accepted while they match. A rejected draft's K/V stays in
the cache, so a scheduler that forgets to recompute it produces wrong outputs.

With ``window`` set it stands in for a hybrid model with two KV cache groups: every token is written to
both, and a context reads the last ``window`` positions through the sliding group's table (group 1, its
own ``sliding_num_blocks`` cache), the rest through group 0's; a sliding block handed to two requests
changes the output, and ``sliding_tables`` (the manager's live tables of group 1) catches a block freed
while the window still reads it.
"""

from __future__ import annotations

import random

import numpy as np

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, num_drafts: int = 0, draft_error_rate: float = 0.0,
                 seed: int = 0, window: int | None = None, sliding_num_blocks: int = 0,
                 sliding_tables: dict | None = None) -> None:
        self.block_size = block_size
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.window = window
        self.kv_sliding = np.full(max(sliding_num_blocks, 1) * block_size, -1, dtype=np.int64)
        self.sliding_tables = sliding_tables
        self.state: dict[str, dict] = {}
        self.num_drafts = num_drafts
        self.draft_error_rate = draft_error_rate
        self.rng = random.Random(seed)

    def _slot(self, st: dict, pos: int, table: str = "blocks") -> int:
        bs = self.block_size
        return st[table][pos // bs] * bs + pos % bs

    def _read(self, st: dict, pos: int, query_pos: int) -> int:
        if self.window is not None and pos > query_pos - self.window:
            slot = self._slot(st, pos, "sliding")
            assert st["sliding"][pos // self.block_size] != 0, "the window reads a null block"
            if self.sliding_tables is not None:
                block = self.sliding_tables[st["rid"]][pos // self.block_size]
                assert block.block_id == st["sliding"][pos // self.block_size] and block.ref_cnt > 0, \
                    "the window reads a block the KV cache manager freed"
            return int(self.kv_sliding[slot])
        return int(self.kv[self._slot(st, pos)])

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.state.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            self.state[new.req_id] = {"tokens": new.prompt_token_ids + new.output_token_ids,
                                      "blocks": list(new.block_ids[0]), "computed": new.num_computed_tokens,
                                      "sliding": list(new.block_ids[-1]), "rid": new.req_id}
        for cached in sched.scheduled_cached_reqs:
            st = self.state[cached.req_id]
            st["blocks"].extend(cached.new_block_ids[0])
            st["sliding"].extend(cached.new_block_ids[-1])
            assert st["computed"] == cached.num_computed_tokens, "scheduler and runner disagree on rollback"
        out = ModelRunnerOutput(sampled_token_ids={})
        bs = self.block_size
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.state[rid]
            drafts = sched.scheduled_spec_decode_tokens.get(rid, [])
            start = st["computed"]
            inputs = st["tokens"] + drafts
            assert start + n == len(inputs) or not drafts, "drafts must follow all the real tokens"
            assert len(st["blocks"]) * bs >= start + n, "not enough blocks for the scheduled tokens"
            for pos in range(start, start + n):
                self.kv[self._slot(st, pos)] = inputs[pos]
                if self.window is not None:
                    self.kv_sliding[self._slot(st, pos, "sliding")] = inputs[pos]
            st["computed"] = start + n
            if st["computed"] < len(st["tokens"]):
                continue  # a partial prefill chunk
            # Verify: the true next token after each real/draft prefix, read back from the cache.
            emitted = []
            first = len(st["tokens"])
            for i in range(len(drafts) + 1):
                context = [self._read(st, p, first + i - 1) for p in range(first + i)]
                token = next_token(context)
                emitted.append(token)
                if i == len(drafts) or drafts[i] != token:
                    break
            st["computed"] -= len(drafts) - (len(emitted) - 1)
            st["tokens"].extend(emitted)
            out.sampled_token_ids[rid] = emitted
            if self.num_drafts:
                out.spec_token_ids[rid] = self._propose(st["tokens"])
        return out

    def _propose(self, tokens: list[int]) -> list[int]:
        context, drafts = list(tokens), []
        for _ in range(self.rng.randint(0, self.num_drafts)):
            token = next_token(context)
            if self.rng.random() < self.draft_error_rate:
                token = (token + 1) % VOCAB
            drafts.append(token)
            context.append(token)
        return drafts


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]
