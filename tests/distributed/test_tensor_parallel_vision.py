"""A vision-language model under tensor parallelism (mp executor, 2 ranks): the images reach every rank with the
step, the vision tower's attention splits its heads like the decoder's, and greedy output equals transformers."""

from __future__ import annotations

import pytest

from helpers.vlm_helpers import (
    QWEN_IMAGE,
    hf_generate,
    make_tiny_gemma3_mm,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    qwen2_vl_generate,
    random_image,
)

pytestmark = pytest.mark.slow  # two rank processes


def _tp2_tokens(path: str, text: str, images: list) -> list[list[int]]:
    """Greedy tokens of one request per image from a 2-rank tensor-parallel engine (mp executor)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=128, dtype="float32")
    try:
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}} for image in images],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.core.close()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_llava_equals_transformers(tmp_path) -> None:
    path, hf, processor = make_tiny_llava(tmp_path / "llava")
    text = "t5 t9 <image> t7 t33"
    images = [random_image(1), random_image(2)]
    assert _tp2_tokens(path, text, images) == [hf_generate(hf, processor, text, [image], 8) for image in images]


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_tp2_qwen2_vl_equals_transformers(tmp_path, version: str) -> None:
    """Qwen2-VL / Qwen2.5-VL: each rank keeps the requests' M-RoPE positions; the ViT's heads (and Qwen2.5's gated
    MLP) split across the ranks."""
    path, hf, processor = make_tiny_qwen2_vl(tmp_path / "qwen", version=version)
    text = f"t5 t9 {QWEN_IMAGE} t7 t33"
    images = [random_image(1), random_image(2, (64, 30))]
    assert _tp2_tokens(path, text, images) == [qwen2_vl_generate(hf, processor, text, [image], 8)
                                               for image in images]


def test_tp2_gemma3_mm_equals_transformers(tmp_path) -> None:
    """Gemma 3: each rank recomputes its own heads' rows of the image runs (two-way attention inside the image)."""
    path, hf, processor = make_tiny_gemma3_mm(tmp_path / "gemma3")
    text = "t5 t9 t11 <start_of_image> t7 t33"
    images = [random_image(1), random_image(2)]
    assert _tp2_tokens(path, text, images) == [hf_generate(hf, processor, text, [image], 8) for image in images]
