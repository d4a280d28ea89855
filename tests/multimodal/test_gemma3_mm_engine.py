"""A tiny random Gemma 3 multimodal model through the engine against transformers' ``generate``: each image's
tokens attend to each other both ways (sliding and full layers), and chunked prefill, prefix-cache hits that end
inside an image, batching and preemption never change the answer."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from helpers.vlm_helpers import (
    GEMMA3_IMAGE_TOKENS,
    encoded_images,
    generated_tokens,
    hf_generate,
    image_prompt,
    make_tiny_gemma3_mm,
    png_data_url,
    random_image,
)

TEXT = "t5 t9 t11 <start_of_image> t7 t33 t45"  # 3 + <boi> + 16 image + <eoi> + 3 tokens
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_gemma3_mm(tmp_path_factory.mktemp("gemma3mm"))


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=tiny[0], dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256)


def _hf_causal_only(hf, processor, text: str, image) -> list[int]:
    """transformers' answer without the image block mask (no token_type_ids): what a causal-only engine gives."""
    inputs = processor(text=text, images=[image], return_tensors="pt")
    inputs.pop("token_type_ids")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_equals_transformers_with_the_image_block_mask(tiny, llm) -> None:
    _, hf, processor = tiny
    images = [random_image(1), random_image(2), random_image(3)]
    refs = [hf_generate(hf, processor, TEXT, [image], MAX_TOKENS) for image in images]
    assert len({tuple(r) for r in refs}) > 1  # the picture matters to this model
    assert generated_tokens(llm, [image_prompt(TEXT, image) for image in images], GREEDY) == refs
    # The two-way attention inside the image matters too: a causal-only model answers otherwise.
    assert any(ref != _hf_causal_only(hf, processor, TEXT, image) for ref, image in zip(refs, images))


def test_text_only_prompt_equals_transformers(tiny, llm) -> None:
    _, hf, processor = tiny
    text = "t5 t9 t7 t33 t45 t40"
    assert generated_tokens(llm, [text], GREEDY) == [hf_generate(hf, processor, text, None, MAX_TOKENS)]


def test_sixteen_requests_four_images_equal_each_alone_and_encode_once(tiny, llm) -> None:
    _, hf, processor = tiny
    images = [random_image(10 + i) for i in range(4)]
    before = encoded_images(llm)
    batched = generated_tokens(llm, [image_prompt(TEXT, images[i % 4]) for i in range(16)], GREEDY)
    assert encoded_images(llm) - before == 4
    llm.reset_prefix_cache()
    alone = [generated_tokens(llm, [image_prompt(TEXT, image)], GREEDY)[0] for image in images]
    assert batched == [alone[i % 4] for i in range(16)]
    assert alone == [hf_generate(hf, processor, TEXT, [image], MAX_TOKENS) for image in images]


def test_a_prefix_hit_that_ends_inside_the_image_equals_transformers(tiny, llm) -> None:
    """"t5 <boi>" puts the image's run at positions 2..17: a second prompt with other text after the image shares
    4 blocks, the last of them mid-image, and computes the rest of the run from position 16."""
    _, hf, processor = tiny
    image = random_image(20)
    first, second = "t5 <start_of_image> t7 t33 t45", "t5 <start_of_image> t40 t41"
    llm.reset_prefix_cache()
    llm.generate(image_prompt(first, image), GREEDY, use_tqdm=False)
    hit = llm.generate(image_prompt(second, image), GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 16
    assert list(hit.outputs[0].token_ids) == hf_generate(hf, processor, second, [image], MAX_TOKENS)
    other = llm.generate(image_prompt(second, random_image(21)), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0  # block 0 holds the image's first token already


def test_chunks_never_split_an_image_and_equal_transformers(tiny) -> None:
    """A step budget of 20 tokens: a chunk that would end inside an image stops before it (the image's tokens
    are computed in one step), so prompts with text before and between two images still equal transformers."""
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256,
              max_num_batched_tokens=20, enable_prefix_caching=False)
    text = "t5 t9 t11 t12 t13 t14 <start_of_image> t7 <start_of_image> t33"
    pairs = [(random_image(40), random_image(41)), (random_image(41), random_image(42))]
    got = generated_tokens(llm, [image_prompt(text, *pair) for pair in pairs], GREEDY)
    assert got == [hf_generate(hf, processor, text, list(pair), MAX_TOKENS) for pair in pairs]
    assert encoded_images(llm) == 3


def test_preempted_requests_equal_transformers(tiny) -> None:
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, kv_cache_memory="60KiB", max_model_len=256,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24)  # stops at EOS, as transformers' generate does
    images = [random_image(50 + i) for i in range(6)]
    outs = llm.generate([image_prompt(TEXT, image) for image in images], params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, image in zip(outs, images):
        assert list(out.outputs[0].token_ids) == hf_generate(hf, processor, TEXT, [image], 24)


def test_chat_content_parts_equal_generate(llm) -> None:
    image = random_image(30)
    messages = [{"role": "user", "content": [{"type": "text", "text": "t5 t9 t11"},
                                              {"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                              {"type": "text", "text": "t7 t33 t45"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert list(chat.outputs[0].token_ids) == generated_tokens(llm, [image_prompt(TEXT, image)], GREEDY)[0]


def test_an_image_larger_than_a_step_is_refused(tiny) -> None:
    llm = LLM(model=tiny[0], dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256,
              max_num_batched_tokens=GEMMA3_IMAGE_TOKENS - 1)
    with pytest.raises(ValueError, match=r"image 1 takes 16 tokens, more than one step's budget"):
        llm.generate(image_prompt(TEXT, random_image(1)), GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
