"""A tiny random LLaVA through the engine against transformers' ``generate``: images change the answer and
match; batching, chunked prefill, preemption and the prefix cache never change it; each image is encoded once."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from helpers.vlm_helpers import (
    IMAGE_TOKENS,
    encoded_images,
    generated_tokens,
    hf_generate,
    image_prompt,
    make_tiny_llava,
    png_data_url,
    random_image,
)

TEXT = "t5 t9 <image> t7 t33 t45"  # 2 + 16 image + 3 tokens
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=tiny[0], dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256)


def test_greedy_equals_transformers_and_the_image_changes_the_answer(tiny, llm) -> None:
    _, hf, processor = tiny
    images = [random_image(1), random_image(2)]
    refs = [hf_generate(hf, processor, TEXT, [image], MAX_TOKENS) for image in images]
    assert refs[0] != refs[1]  # the picture matters to this model
    assert generated_tokens(llm, [image_prompt(TEXT, image) for image in images], GREEDY) == refs


def test_text_only_prompt_equals_transformers(tiny, llm) -> None:
    _, hf, processor = tiny
    text = "t5 t9 t7 t33 t45 t40"
    assert generated_tokens(llm, [text], GREEDY) == [hf_generate(hf, processor, text, None, MAX_TOKENS)]


def test_sixteen_requests_four_images_equal_each_alone_and_encode_once(tiny, llm) -> None:
    _, hf, processor = tiny
    images = [random_image(10 + i) for i in range(4)]
    before = encoded_images(llm)
    batched = generated_tokens(llm, [image_prompt(TEXT, images[i % 4]) for i in range(16)], GREEDY)
    assert encoded_images(llm) - before == 4  # once per image, however many requests send it
    llm.reset_prefix_cache()
    alone = [generated_tokens(llm, [image_prompt(TEXT, image)], GREEDY)[0] for image in images]
    assert batched == [alone[i % 4] for i in range(16)]
    assert alone == [hf_generate(hf, processor, TEXT, [image], MAX_TOKENS) for image in images]
    assert len({tuple(a) for a in alone}) > 1
    assert encoded_images(llm) - before == 4  # the alone runs read the encoder cache


def test_same_image_again_hits_the_prefix_cache_and_another_image_does_not(llm) -> None:
    first, second = random_image(20), random_image(21)
    llm.reset_prefix_cache()
    a = llm.generate(image_prompt(TEXT, first), GREEDY, use_tqdm=False)[0]
    again = llm.generate(image_prompt(TEXT, first), GREEDY, use_tqdm=False)[0]
    other = llm.generate(image_prompt(TEXT, second), GREEDY, use_tqdm=False)[0]
    assert a.num_cached_tokens == 0
    num_prompt = len(a.prompt_token_ids)
    assert again.num_cached_tokens == (num_prompt - 1) // BLOCK * BLOCK  # every full block, image included
    assert list(again.outputs[0].token_ids) == list(a.outputs[0].token_ids)
    assert other.num_cached_tokens == 0  # block 0 already holds image tokens: identical text shares nothing
    assert list(other.outputs[0].token_ids) != list(a.outputs[0].token_ids)


def test_the_same_image_in_another_place_is_another_block(llm) -> None:
    """Text before the image shifts it: blocks covering it must not match the unshifted prompt's."""
    image = random_image(22)
    llm.reset_prefix_cache()
    llm.generate(image_prompt("t5 t9 t3 t4 <image> t7", image), GREEDY, use_tqdm=False)
    shifted = llm.generate(image_prompt("t5 t9 t3 t4 t6 t8 t36 t47 <image> t7", image), GREEDY, use_tqdm=False)[0]
    assert shifted.num_cached_tokens == BLOCK  # the text block only


def test_chat_content_parts_equal_generate(llm) -> None:
    image = random_image(30)
    messages = [{"role": "user", "content": [{"type": "text", "text": "t5 t9"},
                                              {"type": "image_url", "image_url": {"url": png_data_url(image)}},
                                              {"type": "text", "text": "t7 t33 t45"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    # The tiny template renders parts as "t5 t9 <image> t7 t33 t45 " (a trailing space the tokenizer drops).
    assert list(chat.outputs[0].token_ids) == generated_tokens(llm, [image_prompt(TEXT, image)], GREEDY)[0]
    pil = llm.chat([{"role": "user", "content": [{"type": "text", "text": "t5 t9"},
                                                 {"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "t7 t33 t45"}]}], GREEDY, use_tqdm=False)
    assert list(pil[0].outputs[0].token_ids) == list(chat.outputs[0].token_ids)


def test_chunked_prefill_through_images_equals_transformers(tiny) -> None:
    """A step budget of one image: prompts with two images are split into chunks around and inside them; each
    image is still encoded once."""
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256,
              max_num_batched_tokens=IMAGE_TOKENS, enable_prefix_caching=False)
    text = "t5 <image> t9 t7 <image> t33"
    pairs = [(random_image(40), random_image(41)), (random_image(41), random_image(42))]
    got = generated_tokens(llm, [image_prompt(text, *pair) for pair in pairs], GREEDY)
    assert got == [hf_generate(hf, processor, text, list(pair), MAX_TOKENS) for pair in pairs]
    assert encoded_images(llm) == 3


def test_preempted_requests_do_not_encode_again(tiny) -> None:
    """A KV cache too small for all requests at once: they preempt each other; their images stay cached."""
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, kv_cache_memory="40KiB", max_model_len=256,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    images = [random_image(50 + i) for i in range(6)]
    outs = llm.generate([image_prompt(TEXT, image) for image in images], params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert encoded_images(llm) == len(images)
    assert list(outs[0].outputs[0].token_ids) == hf_generate(hf, processor, TEXT, [images[0]], 24)


def test_an_image_larger_than_a_step_is_refused(tiny) -> None:
    llm = LLM(model=tiny[0], dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256,
              max_num_batched_tokens=IMAGE_TOKENS - 1)
    with pytest.raises(ValueError, match=r"image: image 1 takes 16 tokens, more than one step's budget"):
        llm.generate(image_prompt(TEXT, random_image(1)), GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_multimodal_inputs_name_the_problem(tiny, llm) -> None:
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(image_prompt("t5 t9", random_image(1)), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes PIL images"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": "not an image"}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="expected"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"video": []}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not an image"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "data:text/plain;base64,aGVsbG8="}}]}],
                 GREEDY, use_tqdm=False)
    limited = LLM(model=tiny[0], dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256,
                  limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="limit-mm-per-prompt allows 1"):
        limited.generate(image_prompt("t5 <image> <image>", random_image(1), random_image(2)), GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert generated_tokens(llm, [image_prompt(TEXT, random_image(1))], GREEDY)  # still serving


def test_an_image_sent_to_a_text_model_is_refused(tmp_path) -> None:
    from helpers.arch_configs import save_tiny

    path, _ = save_tiny("LlamaForCausalLM", tmp_path / "text")
    llm = LLM(model=path, dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match=r"multi_modal_data: model .* takes text only"):
        llm.generate(image_prompt(TEXT, random_image(1)), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"image_url: model .* takes text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(
            random_image(1))}}]}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_encoder_cache_bound_holds_in_the_runner(tiny) -> None:
    """Room for one image's outputs: requests with different images take turns, the runner drops what the scheduler
    evicts (never more than the bound), and an evicted image is encoded again when it comes back."""
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=BLOCK, kv_cache_memory="4MiB", max_model_len=256,
              encoder_cache_size=IMAGE_TOKENS, enable_prefix_caching=False)
    images = [random_image(60 + i) for i in range(3)]
    outs = generated_tokens(llm, [image_prompt(TEXT, image) for image in images], GREEDY)
    runner = llm.engine.core.worker.runner.multimodal
    assert runner.num_encoded_images == 3
    assert outs == [hf_generate(hf, processor, TEXT, [image], MAX_TOKENS) for image in images]
    # still cached: the last one encoded
    assert generated_tokens(llm, [image_prompt(TEXT, images[2])], GREEDY) == [outs[2]]
    assert runner.num_encoded_images == 3
    # evicted long ago: encoded again
    assert generated_tokens(llm, [image_prompt(TEXT, images[0])], GREEDY) == [outs[0]]
    assert runner.num_encoded_images == 4
    assert len(runner.cache) == 1


def test_checkpoint_names_in_every_layout_reach_our_parameters() -> None:
    """transformers' saved layout, its in-memory one, and the original llava-hf one (vision_tower.vision_model.*);
    vision layers past the feature layer are dropped."""
    from pagedllm.model_executor.models.llava import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.__new__(LlavaForConditionalGeneration)  # naming needs no weights
    object.__setattr__(model, "num_vision_layers", 2)

    names = ["language_model.model.layers.0.mlp.up_proj.weight", "language_model.lm_head.weight",
             "model.language_model.norm.weight", "lm_head.weight",
             "vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight",
             "model.vision_tower.embeddings.class_embedding",
             "vision_tower.encoder.layers.2.layer_norm1.weight", "model.multi_modal_projector.linear_1.bias"]
    ours = [n for n in map(model.our_name, names) if n is not None]
    assert ours == ["model.layers.0.mlp.up_proj.weight", "lm_head.weight", "model.norm.weight", "lm_head.weight",
                    "vision_tower.layers.1.mlp.fc1.weight", "vision_tower.embeddings.class_embedding",
                    "multi_modal_projector.linear_1.bias"]
