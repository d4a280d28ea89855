"""--runner pooling through the transformers fallback: encoders pagedllm has no native code for (tiny random
RoBERTa, XLM-R saved with its masked-LM head, ELECTRA) and a fallback decoder used as an embedder give
transformers' hidden states, pooled, for each prompt of a mixed batch; BERT through the fallback equals native."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM

from helpers.arch_configs import save_word_tokenizer
from helpers.fallback_configs import save_fallback_tiny

MEAN = {"pooling_type": "MEAN", "normalize": False}
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               pad_token_id=0)


def _prompts() -> list[list[int]]:
    return [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 5, 13)]


def _encoder_config(arch: str):
    import transformers as tf

    if arch == "RobertaModel":  # positions start after the padding index
        return tf.RobertaConfig(**_COMMON, max_position_embeddings=258, architectures=[arch])
    if arch == "XLMRobertaForMaskedLM":  # a task checkpoint: "roberta." names and an LM head to drop
        return tf.XLMRobertaConfig(**_COMMON, max_position_embeddings=258, architectures=[arch])
    if arch == "ElectraModel":  # embeddings narrower than the hidden size, projected
        return tf.ElectraConfig(**{**_COMMON, "hidden_size": 64}, embedding_size=32, max_position_embeddings=256,
                                architectures=[arch])
    if arch == "BertModel":
        return tf.BertConfig(**_COMMON, max_position_embeddings=256, architectures=[arch])
    raise KeyError(arch)


def _save_encoder(arch: str, path: Path):
    import transformers as tf

    torch.manual_seed(0)
    config = _encoder_config(arch)
    auto = tf.AutoModelForMaskedLM if arch.endswith("MaskedLM") else tf.AutoModel
    model = auto.from_config(config)
    with torch.no_grad():  # matrices at std 0.08: attention far from uniform, so a leak between prompts shows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model.base_model


def _embed(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("arch", ["RobertaModel", "XLMRobertaForMaskedLM", "ElectraModel"])
def test_encoder_embeddings_match_transformers(arch: str, tmp_path: Path) -> None:
    path, base = _save_encoder(arch, tmp_path)
    llm = LLM(model=path, dtype="float32", runner="pooling", pooler_config=MEAN)
    try:
        mc = llm.engine.config.model
        assert (mc.model_impl, mc.is_encoder_only, mc.runner) == ("transformers", True, "pooling")
        prompts = _prompts()
        for prompt, got in zip(prompts, _embed(llm, prompts)):  # one batch: each prompt attends to its own tokens
            with torch.no_grad():
                expected = base(torch.tensor([prompt])).last_hidden_state[0].mean(0)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    finally:
        llm.engine.core.close()


def test_bert_through_the_fallback_equals_native(tmp_path: Path) -> None:
    path, _ = _save_encoder("BertModel", tmp_path)
    prompts = _prompts()
    got = {}
    for impl in ("pagedllm", "transformers"):
        llm = LLM(model=path, dtype="float32", runner="pooling", pooler_config=MEAN, model_impl=impl)
        try:
            assert llm.engine.config.model.model_impl == impl
            got[impl] = _embed(llm, prompts)
        finally:
            llm.engine.core.close()
    for native, fallback in zip(got["pagedllm"], got["transformers"]):
        torch.testing.assert_close(fallback, native, atol=1e-5, rtol=0)


def test_fallback_decoder_as_an_embedder(tmp_path: Path) -> None:
    """A causal LM without native code, last-token pooled through the paged path (KV cache, chunked prompts)."""
    path, hf = save_fallback_tiny("Olmo2ForCausalLM", tmp_path)
    llm = LLM(model=path, dtype="float32", runner="pooling", kv_cache_memory="8MiB", block_size=8,
              max_num_batched_tokens=16, pooler_config={"pooling_type": "LAST", "normalize": False})
    try:
        assert not llm.engine.config.model.is_encoder_only
        prompts = _prompts()
        for prompt, got in zip(prompts, _embed(llm, prompts)):
            with torch.no_grad():
                expected = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    finally:
        llm.engine.core.close()


def test_an_encoder_cannot_generate(tmp_path: Path) -> None:
    path, _ = _save_encoder("RobertaModel", tmp_path)
    with pytest.raises(ValueError, match="RobertaModel is an encoder-only"):
        LLM(model=path, runner="generate")


def test_a_class_without_layer_indices_is_refused(tmp_path: Path) -> None:
    import transformers as tf

    config = tf.DistilBertConfig(vocab_size=256, dim=64, hidden_dim=128, n_layers=2, n_heads=4, pad_token_id=0,
                                 architectures=["DistilBertModel"])
    tf.AutoModel.from_config(config).save_pretrained(str(tmp_path))
    save_word_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="DistilBertSelfAttention has no layer_idx"):
        LLM(model=str(tmp_path), runner="pooling", dtype="float32")
