"""Tensor parallelism through the mp executor: TP=2 greedy equals TP=1 on a tiny random model of every family
(4 heads, 2 KV heads; float32), quantized int8 and GGUF-kept Q8_0 too; a rank that dies mid-step ends the engine
within seconds, one that exits before it joins fails the start at once; heads that do not divide fail at
start-up naming the numbers."""

from __future__ import annotations

import time

import pytest

from helpers.tp_helpers import greedy, tiny

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM",
         "Phi3ForCausalLM", "GPT2LMHeadModel"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_equals_tp1(arch: str, tmp_path) -> None:
    path = tiny(arch, tmp_path)
    want = greedy(path, 1)
    assert greedy(path, 2) == want


@pytest.mark.slow
def test_int8_tp2_equals_int8_tp1(tmp_path) -> None:
    path = tiny("LlamaForCausalLM", tmp_path)
    want = greedy(path, 1, quantization="int8")
    assert want != greedy(path, 1)  # the quantized model really is another model
    assert greedy(path, 2, quantization="int8") == want


@pytest.mark.slow
def test_gguf_kept_q8_0_tp2_equals_tp1(tmp_path) -> None:

    from pagedllm.config import ModelConfig
    from pagedllm.model_executor.loader import resolve_model_config

    from helpers.arch_configs import hf_model, tiny_config
    from helpers.gguf_writer import write_gguf

    hf = hf_model(tiny_config("LlamaForCausalLM"), seed=3)
    path = write_gguf(hf, tmp_path / "tiny.Q8_0.gguf", quantized=True)
    assert resolve_model_config(ModelConfig(model=path, dtype="float32")).quantization == "gguf"
    assert greedy(path, 2) == greedy(path, 1)


def test_heads_that_do_not_divide_fail_naming_them(tmp_path) -> None:
    from pagedllm.distributed import parallel_state
    from pagedllm.model_executor.models.blocks import RotaryAttention

    parallel_state._TP = parallel_state.TensorParallelGroup(0, 3, "gloo")
    try:
        with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*num_attention_heads \(4\)"):
            RotaryAttention(64, 4, 2, 16, layer_idx=0, dtype=__import__("torch").float32, prefix="model.layers.0")
        parallel_state._TP = parallel_state.TensorParallelGroup(0, 4, "gloo")
        with pytest.raises(ValueError, match=r"tensor_parallel_size 4 is neither .*num_key_value_heads \(3\)"):
            RotaryAttention(64, 8, 3, 8, layer_idx=0, dtype=__import__("torch").float32, prefix="model.layers.0")
    finally:
        parallel_state._TP = parallel_state.TensorParallelGroup()


def test_more_ranks_than_cores_fails_at_start_up() -> None:
    from pagedllm.engine_args import EngineArgs
    from pagedllm.executor import check_tensor_parallel
    from pagedllm.utils import physical_cpu_cores

    too_many = physical_cpu_cores() + 1
    args = EngineArgs(tensor_parallel_size=too_many, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=f"tensor_parallel_size {too_many} is more than this host's"):
        check_tensor_parallel(args.create_engine_config())
    with pytest.raises(ValueError, match="distributed_executor_backend 'uni' runs one rank"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni").create_engine_config()


@pytest.mark.parametrize(("model", "runner", "says"), [
    ("all-minilm-l6-v2", "pooling", "pooling .embedding. models run on one rank"),
    ("whisper-tiny.en", "auto", "WhisperForConditionalGeneration .encoder-decoder. runs on one rank")])
def test_models_that_do_not_split_say_so(model: str, runner: str, says: str) -> None:
    from pagedllm.engine_args import EngineArgs
    from pagedllm.executor import check_tensor_parallel

    config = EngineArgs(model=model, runner=runner, tensor_parallel_size=2, device="cpu").create_engine_config()
    with pytest.raises(ValueError, match=says):
        check_tensor_parallel(config)


@pytest.mark.slow
def test_rank_killed_mid_step_ends_the_engine(tmp_path, monkeypatch) -> None:
    from pagedllm import LLM, SamplingParams, executor
    from pagedllm.executor.multiproc_executor import MultiprocExecutor, RankDiedError

    from helpers.faulty_rank import run_dying_rank

    monkeypatch.setattr(executor, "make_executor", lambda config: MultiprocExecutor(config, rank_target=run_dying_rank))
    llm = LLM(tiny("LlamaForCausalLM", tmp_path), tensor_parallel_size=2, kv_cache_memory="16MiB",
              max_model_len=128, dtype="float32")
    try:
        start = time.monotonic()
        with pytest.raises(RankDiedError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with status 9"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=20),
                         use_tqdm=False)
        assert time.monotonic() - start < 10.0
    finally:
        llm.engine.core.close()


def test_rank_dying_before_it_joins_fails_the_start_at_once(tmp_path) -> None:
    from pagedllm.engine_args import EngineArgs
    from pagedllm.executor.multiproc_executor import MultiprocExecutor, RankDiedError

    from helpers.faulty_rank import run_rank_dying_before_it_joins

    config = EngineArgs(model=tiny("LlamaForCausalLM", tmp_path), tensor_parallel_size=2, dtype="float32",
                        kv_cache_memory="16MiB", max_model_len=128).create_engine_config()
    start = time.monotonic()
    with pytest.raises(RankDiedError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with status 7"):
        MultiprocExecutor(config, rank_target=run_rank_dying_before_it_joins)
    assert time.monotonic() - start < 60.0  # the join itself would wait up to RANK_STARTUP_TIMEOUT_S (900 s)


@pytest.mark.slow
def test_fp8_kv_cache_tp2_equals_tp1(tmp_path) -> None:
    """An fp8 cache (scales 1.0, keys stored rotated per head) splits by KV heads like any other: each rank rotates
    and rounds its own heads as one rank does."""
    path = tiny("LlamaForCausalLM", tmp_path)
    want = greedy(path, 1, kv_cache_dtype="fp8")
    assert greedy(path, 2, kv_cache_dtype="fp8") == want
