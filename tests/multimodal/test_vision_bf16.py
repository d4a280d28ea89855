"""The vision-language models in bfloat16 (the towers through the bf16 linear paths, their GELU fused into fc1's
matmul, each residual add in one pass with the LayerNorm after it) against transformers in float32: the next
token's log-probabilities after an image prompt (Qwen2-VL's with M-RoPE positions too) stay within the bf16
bound the text models' tests use."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from helpers.vlm_helpers import (
    QWEN_IMAGE,
    make_tiny_gemma3_mm,
    make_tiny_idefics3,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    qwen2_vl_inputs,
    random_image,
)

BF16_REL_TOL = 3e-2  # of the reference logits' range, as tests/models/test_llama.py
TOP = 20
PROMPT = "t5 t9 <image> t7 t33"
MAKERS = {"llava": make_tiny_llava, "idefics3": make_tiny_idefics3, "qwen2_vl": make_tiny_qwen2_vl,
          "gemma3": make_tiny_gemma3_mm}
IMAGE_TAGS = {"qwen2_vl": QWEN_IMAGE, "gemma3": "<start_of_image>"}


def _prompt(family: str) -> str:
    return PROMPT.replace("<image>", IMAGE_TAGS.get(family, "<image>"))


def _reference_logprobs(hf, processor, family: str, image) -> torch.Tensor:
    if family == "qwen2_vl":
        inputs = qwen2_vl_inputs(processor, _prompt(family), [image])
    else:
        inputs = processor(text=_prompt(family), images=[image] if family in ("llava", "gemma3") else [[image]],
                           return_tensors="pt")
    with torch.no_grad():
        return torch.log_softmax(hf(**inputs).logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_bf16_next_token_logprobs_within_the_bf16_bound(family, tmp_path) -> None:
    path, hf, processor = MAKERS[family](tmp_path)
    image, other = random_image(5), random_image(6)
    ref = _reference_logprobs(hf, processor, family, image)
    tol = BF16_REL_TOL * (ref.max() - ref.min()).item()
    # The bound is tight enough to tell the image apart: another picture moves the reference by more.
    assert (_reference_logprobs(hf, processor, family, other) - ref).abs().max().item() > tol

    llm = LLM(model=path, dtype="bfloat16", block_size=4, kv_cache_memory="4MiB", max_model_len=256)
    model = llm.engine.core.worker.runner.model
    assert model.dtype == torch.bfloat16
    tower = {"idefics3": "vision_model", "qwen2_vl": "visual"}.get(family, "vision_tower")
    tower_layer = getattr(model, tower).layers[0]
    assert tower_layer.mlp.fc1.weight is None or tower_layer.mlp.fc1.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP)
    out = llm.generate({"prompt": _prompt(family), "multi_modal_data": {"image": image}}, params, use_tqdm=False)[0]
    ours = out.outputs[0].logprobs[0]
    assert len(ours) >= TOP
    for token, logprob in ours.items():
        assert abs(logprob.logprob - ref[token].item()) < tol, (token, logprob.logprob, ref[token].item())
    assert out.outputs[0].token_ids[0] in set(ref.topk(3).indices.tolist())
