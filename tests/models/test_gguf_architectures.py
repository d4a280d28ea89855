"""GGUF files of every generative architecture (written here as llama.cpp lays them out, F32 and Q8_0) vs
transformers on the same tiny random model: config from the metadata, logits, tokenizer from the file, and
an unsupported GGUF architecture's error."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import load_model, resolve_model_config

from helpers.arch_configs import WINDOW, hf_model, tiny_config
from helpers.gguf_writer import quantize_roundtrip, write_gguf
from helpers.model_helpers import prefill_logits

ATOL = 2e-4
ORIGINAL = 32  # Phi-3 LongRoPE: original context of the tiny model (the test prompt is longer)


def _phi3_longrope_sliding():
    cfg = tiny_config("Phi3ForCausalLM")
    cfg.sliding_window = WINDOW
    cfg.original_max_position_embeddings = ORIGINAL
    cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0,
                           "short_factor": [1.0 + 0.1 * i for i in range(8)],
                           "long_factor": [1.0 + 1.3 * i for i in range(8)],
                           "original_max_position_embeddings": ORIGINAL}
    return cfg


def _mistral_sliding():
    return tiny_config("MistralForCausalLM")


def _qwen2_yarn():
    cfg = tiny_config("Qwen2ForCausalLM")
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64}
    return cfg


def _llama3_rope():
    cfg = tiny_config("LlamaForCausalLM")
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return cfg


CASES = {
    "llama3-rope-freqs": _llama3_rope,  # Llama 3.1 scaling as llama.cpp stores it: a rope_freqs tensor
    "mistral-sliding": _mistral_sliding,  # llama architecture: q/k rows permuted in the file
    "qwen2": lambda: tiny_config("Qwen2ForCausalLM"),
    "qwen2-yarn": _qwen2_yarn,
    "qwen3": lambda: tiny_config("Qwen3ForCausalLM"),
    "phi3": lambda: tiny_config("Phi3ForCausalLM"),
    "phi3-longrope-sliding": _phi3_longrope_sliding,
    "gpt2": lambda: tiny_config("GPT2LMHeadModel"),
}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[(c, q) for c in CASES for q in ("F32", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def gguf_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    case, qtype = request.param
    hf = hf_model(CASES[case]())
    if qtype == "Q8_0":
        quantize_roundtrip(hf)  # the reference holds the very values the file stores
    path = write_gguf(hf, tmp_path_factory.mktemp(case) / f"tiny-{case}.{qtype}.gguf", quantized=qtype == "Q8_0")
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32"))
    # No --quantization: Q8_0 blocks stay quantized on the CPU; an all-float file has nothing to keep.
    assert mc.quantization == ("gguf" if qtype == "Q8_0" else "none")
    return case, hf, mc


def test_config_from_metadata(gguf_case) -> None:
    case, hf, mc = gguf_case
    want, got = hf.config, mc.hf_config
    assert mc.architecture == want.architectures[0]
    assert mc.vocab_size == 256
    if case == "gpt2":
        assert (got.n_embd, got.n_layer, got.n_head, got.n_positions) == (64, 2, 4, 256)
        return
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, key) == getattr(want, key), key
    assert getattr(got, "head_dim", None) in (None, getattr(want, "head_dim", None) or 16)
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    assert getattr(got, "sliding_window", None) == getattr(want, "sliding_window", None)
    if case.startswith("llama3"):
        assert got.rope_parameters["rope_type"] == "default" and len(got.rope_freq_factors) == 8
    else:
        assert got.rope_parameters["rope_type"] == want.rope_parameters["rope_type"]


def test_logits_match_transformers(gguf_case) -> None:
    """A 40-token prompt: past the sliding window (16) and past the LongRoPE original length (32)."""
    _, hf, mc = gguf_case
    model = load_model(mc, torch.device("cpu"))
    ids = _ids(40, seed=1)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_kept_quantized_logits_match_transformers(case: str, tmp_path) -> None:
    """``quantization="gguf"``: the Q8_0 blocks stay quantized (fused q/k/v and gate/up handed over per
    shard, GPT-2's matrices not transposed); the reference holds the same Q8_0 values."""
    hf = hf_model(CASES[case]())
    quantize_roundtrip(hf)
    path = write_gguf(hf, tmp_path / f"{case}.Q8_0.gguf", quantized=True)
    mc = resolve_model_config(ModelConfig(model=path, dtype="float32", quantization="gguf"))
    model = load_model(mc, torch.device("cpu"))
    ids = _ids(40, seed=2)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, ids, block_size=8), want, atol=ATOL, rtol=0)


# transformers reads a MistralConfig'd file through a "mistral" name map gguf-py lacks; the llama-architecture
# layout (q/k permutation) is covered by the llama3 case.
@pytest.mark.parametrize("case", [c for c in CASES if c != "mistral-sliding"])
def test_transformers_reads_the_written_file_the_same(case: str, tmp_path) -> None:
    """An independent check of the tests' writer: transformers' own GGUF loader (given the config) reads
    the file back into the very model that was written, so the layout is the one GGUF readers expect."""
    import copy

    from transformers import AutoModelForCausalLM

    hf = hf_model(CASES[case]())
    path = write_gguf(hf, tmp_path / f"{case}.gguf")
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.rsplit("/", 1)[1],
                                               config=copy.deepcopy(hf.config), dtype=torch.float32).eval()
    ids = torch.tensor([_ids(40, seed=7)])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, hf(ids).logits, atol=1e-6, rtol=0)


def test_rope_freqs_change_the_logits(tmp_path) -> None:
    """The Llama 3.1 case is sensitive to its factors: the same weights with plain rope give other logits."""
    hf = hf_model(_llama3_rope())
    mc = resolve_model_config(ModelConfig(model=write_gguf(hf, tmp_path / "l3.gguf"), dtype="float32"))
    assert max(mc.hf_config.rope_freq_factors) == pytest.approx(8.0)
    ids = _ids(40, seed=1)
    scaled = prefill_logits(load_model(mc, torch.device("cpu")), ids, block_size=8)
    mc.hf_config.rope_freq_factors = None
    plain = prefill_logits(load_model(mc, torch.device("cpu")), ids, block_size=8)
    assert (scaled - plain).abs().max() > 1e-2


def test_tokenizer_from_the_file(gguf_case) -> None:
    from pagedllm.model_executor.loader.tokenizer import load_tokenizer

    _, _, mc = gguf_case
    tok = load_tokenizer(mc)
    assert tok("ba ab")["input_ids"][-4:] == [98, 97, 32, 255]  # one token per byte, "ab" merged (the last)
    assert tok.eos_token_id == 2


def test_engine_greedy_from_gguf(tmp_path) -> None:
    """The whole engine on a GGUF Qwen2 (tokenizer from the file too) vs transformers' greedy tokens."""
    from pagedllm import LLM, SamplingParams

    from helpers.arch_configs import hf_greedy

    hf = hf_model(tiny_config("Qwen2ForCausalLM"), seed=3)
    path = write_gguf(hf, tmp_path / "qwen2.gguf")
    llm = LLM(model=path, dtype="float32", kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=64)
    prompts = [_ids(n, seed=20 + n) for n in (6, 29)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 10)


def test_only_llama_rows_are_unpermuted(tmp_path) -> None:
    """Qwen2 files store q/k rows as HF does: they load as stored, while the llama un-permutation applied to
    them would scramble the rows (the guard that it stays llama-only)."""
    from pagedllm.model_executor.loader.gguf_file import GGUFFile
    from pagedllm.model_executor.loader.gguf_llama import iter_gguf_llama_weights, iter_gguf_weights

    hf = hf_model(tiny_config("Qwen2ForCausalLM"))
    mc = resolve_model_config(ModelConfig(model=write_gguf(hf, tmp_path / "q.gguf"), dtype="float32"))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"
    loaded = dict(iter_gguf_weights(GGUFFile(mc.gguf_file), mc.hf_config))
    as_llama = dict(iter_gguf_llama_weights(GGUFFile(mc.gguf_file), mc.hf_config))
    for name in (q, k):
        assert torch.equal(loaded[name], hf.state_dict()[name])
        assert not torch.equal(as_llama[name], hf.state_dict()[name])


def test_unsupported_gguf_architecture_lists_the_supported_ones(tmp_path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported; supported GGUF "
                                         "architectures: gemma3, gpt2, llama, phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
        resolve_model_config(ModelConfig(model=str(tmp_path / "falcon.gguf")))
