"""A tiny random Qwen2-VL and Qwen2.5-VL (dynamic resolution, 2D rotary in the vision tower, Qwen2.5's windows;
M-RoPE in the decoder) through the engine against transformers' ``generate``: images of different sizes, several
per prompt, chunked prefill through them, batching, prefix caching keyed by the image."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams

from helpers.vlm_helpers import (
    QWEN_IMAGE,
    make_tiny_qwen2_vl,
    png_data_url,
    qwen2_vl_generate,
    qwen2_vl_inputs,
    random_image,
)

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ONE = f"t5 t9 {QWEN_IMAGE} t7 t33"
TWO = f"t5 {QWEN_IMAGE} t9 {QWEN_IMAGE} t7"


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2_vl", "qwen2_5_vl"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Qwen2-VL, and Qwen2.5-VL (windowed ViT): every test runs on both."""
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"), version=request.param)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model=tiny[0], dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=256)


def _prompt(text: str, images: list) -> dict | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


# (text, images): a 48 x 40 picture is a 6 x 4 patch grid (3 x 2 merged: positions wider than tall), a 64 x 30 one
# 8 x 4, a 30 x 64 one 4 x 8 (taller), and a prompt with two pictures and text between them.
CASES = [(ONE, [random_image(1)]), (ONE, [random_image(2)]), (ONE, [random_image(3, (64, 30))]),
         (ONE, [random_image(4, (30, 64))]), (TWO, [random_image(5), random_image(6, (64, 30))]),
         ("t5 t9 t7 t33", [])]


@pytest.fixture(scope="module")
def references(tiny) -> list[list[int]]:
    _, hf, processor = tiny
    return [qwen2_vl_generate(hf, processor, text, images, MAX_TOKENS) for text, images in CASES]


def test_prompt_positions_equal_transformers_rope_index(tiny) -> None:
    from pagedllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    _, hf, processor = tiny
    images = [random_image(5), random_image(6, (64, 30))]
    inputs = qwen2_vl_inputs(processor, TWO, images)
    ref, ref_delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             image_grid_thw=inputs["image_grid_thw"])
    ids = inputs["input_ids"][0].tolist()
    pad = processor[1].convert_tokens_to_ids("<|image_pad|>")
    starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]

    class Feature:  # what the runner hands over: where the image's tokens start, its processor output
        def __init__(self, offset: int, grid: torch.Tensor) -> None:
            self.offset, self.data = offset, {"image_grid_thw": grid.numpy()[None]}

    model = Qwen2VLForConditionalGeneration.__new__(Qwen2VLForConditionalGeneration)
    model.merge = 2
    ours, delta = model.mrope_positions(len(ids), [Feature(s, g) for s, g in zip(starts, inputs["image_grid_thw"])])
    assert np.array_equal(ours, ref[:, 0].numpy()) and delta == int(ref_delta)
    assert delta != 0  # the images make the decode positions differ from the token index


def test_greedy_equals_transformers_and_the_image_changes_the_answer(llm, references) -> None:
    assert references[0] != references[1]
    outs = [llm.generate(_prompt(text, images), GREEDY, use_tqdm=False)[0] for text, images in CASES]
    assert [list(o.outputs[0].token_ids) for o in outs] == references


def test_batched_requests_equal_transformers(llm, references) -> None:
    """Every case in one batch (several times over, different sizes side by side): each equals its reference."""
    prompts = [_prompt(text, images) for text, images in CASES] * 2
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == references * 2


def test_same_image_again_hits_the_prefix_cache_and_another_image_does_not(tiny, llm, references) -> None:
    first = llm.generate(_prompt(*CASES[0]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(_prompt(*CASES[0]), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and list(again.outputs[0].token_ids) == references[0]
    assert list(first.outputs[0].token_ids) == references[0]
    fresh = random_image(7)  # same text and size as CASES[0], pixels not seen before
    other = llm.generate(_prompt(ONE, [fresh]), GREEDY, use_tqdm=False)[0]
    image_start = 2 + 1  # "t5 t9 <|vision_start|>": the blocks before the image may be shared, none after
    assert other.num_cached_tokens <= image_start
    assert list(other.outputs[0].token_ids) == qwen2_vl_generate(tiny[1], tiny[2], ONE, [fresh], MAX_TOKENS)


def test_chunked_prefill_through_images_equals_transformers(tiny, references) -> None:
    chunked = LLM(model=tiny[0], dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=256,
                  max_num_batched_tokens=8, enable_prefix_caching=False)  # chunks end inside the images
    outs = chunked.generate([_prompt(text, images) for text, images in CASES], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == references
    assert chunked.engine.core.worker.runner.multimodal.num_encoded_images == 6


def test_chat_content_parts_equal_transformers(tiny, llm) -> None:
    """OpenAI-style content parts through the model's chat template (<|vision_start|><|image_pad|><|vision_end|>
    where the image goes) and the images-only processor."""
    image = random_image(31, (56, 24))
    messages = [{"role": "user", "content": [{"type": "text", "text": "t5 t9"},
                                              {"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                              {"type": "text", "text": "t7 t33"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert list(chat.outputs[0].token_ids) == qwen2_vl_generate(tiny[1], tiny[2], ONE, [image], MAX_TOKENS)
