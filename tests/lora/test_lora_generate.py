"""Adapters through the whole engine, float32, against transformers + peft: each adapter alone, a batch mixing the
base model with four adapters of different ranks, more adapters than slots, and the prefix cache's two traps (one
name reloaded with other weights; the base model and an adapter on one prompt)."""

from __future__ import annotations

import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest

from helpers.arch_configs import save_word_tokenizer
from helpers.lora_helpers import make_adapter, peft_greedy
from helpers.model_helpers import make_tiny_llama

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[1, *range(10, 45)], [1, 7, 99, 3, 42, 42, 8], [1, *range(200, 140, -3)]]
# (rank, targets, extra LoraConfig settings) of the four adapters: ranks differ, and so do the modules they touch.
ADAPTERS = [
    (2, ["q_proj", "v_proj"], {}),
    (4, ["gate_proj", "down_proj"], {}),
    (8, None, {"use_rslora": True}),
    (16, ["k_proj", "o_proj", "up_proj"], {}),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = make_tiny_llama(root / "base")
    save_word_tokenizer(base)
    paths = [make_adapter(base, root / f"a{i}", r=r, targets=t, seed=10 + i, **kw)
             for i, (r, t, kw) in enumerate(ADAPTERS)]
    expected = {None: [peft_greedy(base, None, p, MAX_TOKENS) for p in PROMPTS]}
    for path in paths:
        expected[path] = [peft_greedy(base, path, p, MAX_TOKENS) for p in PROMPTS]
    return root, base, paths, expected


def _llm(base: str, **kwargs) -> LLM:
    kwargs = {"kv_cache_memory": "8MiB", **kwargs}
    return LLM(base, enable_lora=True, dtype="float32", kv_cache_dtype="float32", max_model_len=128, **kwargs)


@pytest.fixture(scope="module")
def llm(setup) -> LLM:
    return _llm(setup[1], max_loras=4, max_lora_rank=16)


def _run(llm: LLM, prompts, loras) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


def test_each_adapter_changes_the_output_and_equals_peft(setup, llm) -> None:
    _, _, paths, expected = setup
    for path in paths:
        assert expected[path] != expected[None], f"adapter {path} does not change the greedy output"
    assert _run(llm, PROMPTS, None) == expected[None]  # base-only decode steps replay the recorded step graphs
    assert llm.engine.core.worker.runner.decode_graphs is not None
    for i, path in enumerate(paths):
        assert _run(llm, PROMPTS, LoRARequest(f"a{i}", i + 1, path)) == expected[path]


def test_adapter_decode_steps_replay_the_step_graphs(setup, llm, monkeypatch) -> None:
    """With the C++ kernel, a decode step carrying adapters replays a recorded CPU step graph (its rows' slots read
    at replay) and still equals peft; base rows beside them equal the base model."""
    _, _, paths, expected = setup
    runner = llm.engine.core.worker.runner
    assert runner.lora.graphs_hold_adapters
    graphs, replayed = runner.decode_graphs, []
    replay = graphs.run

    def counting(input_ids, positions, meta):
        replayed.append(runner.lora.context.active)  # True: this step has adapter rows
        return replay(input_ids, positions, meta)

    monkeypatch.setattr(graphs, "run", counting)
    loras = [LoRARequest("a0", 1, paths[0]), None, LoRARequest("a2", 3, paths[2])]
    want = [expected[paths[0]][0], expected[None][1], expected[paths[2]][2]]
    assert _run(llm, PROMPTS, loras) == want
    assert len(replayed) == MAX_TOKENS - 1 and all(replayed)  # every decode step of the batch: a graph
    assert not runner.lora.context.active and int(runner.lora.context.row_slots.max()) == -1  # reset after


def test_a_mixed_batch_equals_each_request_alone(setup, llm) -> None:
    _, _, paths, expected = setup
    loras = [None, *[LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]]
    prompts, batch_loras, want = [], [], []
    for k, prompt in enumerate(PROMPTS):
        for lora in loras:
            prompts.append(prompt)
            batch_loras.append(lora)
            want.append(expected[lora.lora_path if lora else None][k])
        # rotate so that neighbouring rows change adapters differently per prompt
        loras = loras[1:] + loras[:1]
    assert _run(llm, prompts, batch_loras) == want


def test_more_adapters_than_slots_all_answer_right(setup) -> None:
    _, base, paths, expected = setup
    llm = _llm(base, max_loras=2, max_cpu_loras=3, max_lora_rank=16)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)] * 2 + [None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    want = [expected[lora.lora_path if lora else None][i % len(PROMPTS)] for i, lora in enumerate(loras)]
    assert _run(llm, prompts, loras) == want
    manager = llm.engine.core.worker.runner.lora
    assert len(manager.loaded) <= 3 and len(manager.slots) == 2


def test_one_name_reloaded_with_other_weights_never_reuses_old_blocks(setup, llm, tmp_path) -> None:
    _, base, paths, expected = setup
    folder = tmp_path / "same_name"
    shutil.copytree(paths[0], folder)
    first = _run(llm, [PROMPTS[0]], LoRARequest("same", 77, str(folder)))
    assert first == [expected[paths[0]][0]]
    shutil.rmtree(folder)
    make_adapter(base, folder, r=2, targets=["q_proj", "v_proj"], seed=99)  # other weights: same name, id, path
    want = peft_greedy(base, str(folder), PROMPTS[0], MAX_TOKENS)
    assert want != first[0]
    second = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("same", 77, str(folder)))
    assert list(second[0].outputs[0].token_ids) == want
    assert second[0].num_cached_tokens == 0  # the old weights' blocks hold other K/V: never a hit
    again = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("renamed", 78, str(folder)))
    assert again[0].num_cached_tokens == 32  # the same content under another name: its own blocks are hits


def test_base_and_adapter_on_one_long_prompt_do_not_share_blocks(setup, llm) -> None:
    _, _, paths, expected = setup
    prompt = [1, *range(60, 110)]  # 51 tokens: three full blocks of 16
    want_base = peft_greedy(setup[1], None, prompt, MAX_TOKENS)
    want_lora = peft_greedy(setup[1], paths[1], prompt, MAX_TOKENS)
    assert want_base != want_lora
    lora = LoRARequest("a1", 2, paths[1])
    for _ in range(2):  # the second round hits the cache of each, never of the other
        base_out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        lora_out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert list(base_out.outputs[0].token_ids) == want_base
        assert list(lora_out.outputs[0].token_ids) == want_lora
    assert base_out.num_cached_tokens == 48 and lora_out.num_cached_tokens == 48


def test_lora_request_without_enable_lora_names_the_setting(setup) -> None:
    llm = LLM(setup[1], dtype="float32", kv_cache_memory="8MiB", max_model_len=128)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, setup[2][0]))
    assert not llm.engine.has_unfinished_requests()


def test_chunked_prefill_and_preemption_keep_each_adapter(setup) -> None:
    _, base, paths, _ = setup
    # 30-token prompts in 64-token steps: the third request's prompt is cut into chunks. Nine usable blocks hold
    # four requests of two blocks; each needs a third as it passes 32 tokens, so some are preempted (recompute).
    llm = _llm(base, max_loras=4, max_lora_rank=16, max_num_batched_tokens=64, kv_cache_memory="80KiB")
    prompt = [1, *range(70, 99)]
    loras = [LoRARequest("a0", 1, paths[0]), None, LoRARequest("a2", 3, paths[2]), LoRARequest("a3", 4, paths[3])]
    want = [peft_greedy(base, lora.lora_path if lora else None, prompt, MAX_TOKENS) for lora in loras]
    assert _run(llm, [prompt] * len(loras), loras) == want
    assert llm.engine.core.scheduler.num_preemptions > 0
