"""A tiny random Idefics3 (SmolVLM's design: image splitting into tiles, pixel shuffle, tags between tiles) through
the engine against transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from helpers.vlm_helpers import make_tiny_idefics3, random_image

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


def _reference(hf, processor, text: str, images: list) -> list[int]:
    inputs = processor(text=text, images=[images] if images else None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_tiles_and_tags_equal_transformers(tiny) -> None:
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=256,
              max_num_batched_tokens=24)  # prompts of 35-53 tokens: chunks end inside the images' spans
    cases = [("t5 t9 <image> t7 t33", [random_image(1)]), ("t5 t9 <image> t7 t33", [random_image(2)]),
             ("t5 <image> t9 <image> t7", [random_image(3), random_image(4, (64, 30))]),
             ("t5 t9 t7 t33", [])]
    refs = [_reference(hf, processor, text, images) for text, images in cases]
    assert refs[0] != refs[1]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    assert llm.engine.core.worker.runner.multimodal.num_encoded_images == 4
    again = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and list(again.outputs[0].token_ids) == refs[0]
    assert llm.engine.core.worker.runner.multimodal.num_encoded_images == 4
