"""A hybrid model (Gemma 3: 5 sliding-window layers to 1 full-attention layer) keeps two KV cache groups: the
sliding layers' blocks stay bounded by the window while the full layers' grow, and outputs still match
transformers, batched or solo, with prefix hits, preemption and aborts (the core rules:
tests/core/test_kv_cache_groups.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine_args import EngineArgs

from helpers.arch_configs import WINDOW, hf_greedy, save_tiny

BLOCK, CHUNK = 8, 32


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny("Gemma3ForCausalLM", tmp_path_factory.mktemp("gemma3_groups"), seed=11)


def make_engine(path: str, memory: str = "4MiB", **kw) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory=memory,
                                                 block_size=BLOCK, max_num_batched_tokens=CHUNK, **kw))


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def held(kv, group: int, rid: str) -> int:
    g = kv.groups[group]
    return sum(1 for b in g.req_to_blocks.get(rid, []) if b is not g.pool.null_block)


def all_blocks_back(kv) -> bool:
    return all(g.pool.num_free_blocks == g.num_usable_blocks and not g.req_to_blocks for g in kv.groups)


def run(engine: LLMEngine, requests: dict[str, list[int]], max_tokens: int, on_step=None) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        if on_step is not None:
            on_step()
    return out


@pytest.mark.slow  # long engine runs beside transformers: a minute or more on 2 cores, like the others marked slow here
def test_long_request_matches_transformers_with_sliding_blocks_bounded(gemma3) -> None:
    path, hf = gemma3
    engine = make_engine(path, max_num_seqs=1)  # a sliding group of 9 blocks: freed blocks are reused at once
    kv = engine.core.scheduler.kv
    assert len(kv.groups) == 2 and kv.groups[1].pool.num_blocks == 9
    assert kv.groups[1].sliding_window == WINDOW and kv.sliding_window is None
    prompt = prompt_of(6 * WINDOW, 1)  # 96 tokens, six windows
    peaks = [0, 0]

    def track() -> None:
        for g in (0, 1):
            peaks[g] = max(peaks[g], held(kv, g, "long"))

    out = run(engine, {"long": prompt}, 40, track)
    # The window plus a chunk written before it attends, plus the block being filled.
    assert peaks[1] <= -(-(WINDOW + CHUNK) // BLOCK) + 1, peaks
    assert peaks[0] == -(-(len(prompt) + 40 - 1) // BLOCK)  # the full layers keep every block
    assert all_blocks_back(kv)
    assert out["long"] == hf_greedy(hf, prompt, 40)


def test_sliding_group_is_sized_for_the_window(gemma3) -> None:
    path, _ = gemma3
    engine = make_engine(path, max_num_seqs=4)
    cache = engine.config.cache
    assert cache.sliding_group_window == WINDOW
    # Per request the window's blocks + 2, plus one step's tokens, plus the null block.
    assert cache.sliding_group_num_blocks == 4 * (WINDOW // BLOCK + 2) + CHUNK // BLOCK + 1 < cache.num_blocks
    runner = engine.core.worker.runner
    assert [c.shape[1] for c in runner.kv_caches] == [cache.sliding_group_num_blocks] * 5 + [cache.num_blocks]


@pytest.mark.slow
def test_batched_equals_solo_and_prefix_hits_keep_outputs(gemma3) -> None:
    path, hf = gemma3
    engine = make_engine(path, max_num_seqs=4)  # the sliding group sized for the window: blocks get reused
    prompts = {f"p{n}": prompt_of(n, n) for n in (9, 40, 75)}
    prompts["shared"] = prompts["p75"][:64] + prompt_of(20, 99)  # a prefix hit past the window
    batched = run(engine, prompts, 12)
    for rid, prompt in prompts.items():
        assert batched[rid] == hf_greedy(hf, prompt, 12), rid
    # Again, each alone: now served from the prefix cache.
    for rid, prompt in prompts.items():
        again = run(engine, {rid + "-again": prompt}, 12)[rid + "-again"]
        assert again == batched[rid]
    assert engine.core.scheduler.kv.prefix_cache_hits >= 64 + 72
    assert all_blocks_back(engine.core.scheduler.kv)


@pytest.mark.slow
def test_preemption_and_abort_return_every_block(gemma3) -> None:
    path, hf = gemma3
    # 2 KiB per full block (1 layer), 10 KiB per sliding block (5 layers): the sliding group gets its 21
    # blocks, the full group 30 (240 tokens), so four requests of up to 95 tokens cannot all run at once.
    engine = make_engine(path, memory="270KiB", max_num_seqs=4, enable_prefix_caching=False)
    kv = engine.core.scheduler.kv
    assert [g.pool.num_blocks for g in kv.groups] == [30, 21]
    prompts = {f"r{i}": prompt_of(50 + 5 * i, 20 + i) for i in range(4)}
    out = run(engine, prompts, 30)
    assert engine.core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert out[rid] == hf_greedy(hf, prompt, 30), rid
    assert all_blocks_back(kv)
    # Abort one mid-way: both groups get its blocks back.
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("gone", {"prompt_token_ids": prompts["r0"]}, params)
    for _ in range(4):
        engine.step()
    assert held(kv, 0, "gone") and held(kv, 1, "gone")
    engine.abort_request(["gone"])
    assert all_blocks_back(kv)
