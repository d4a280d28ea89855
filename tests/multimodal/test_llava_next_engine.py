"""A tiny random LLaVA-NeXT through the engine against transformers' ``generate``: pictures of different shapes
take different grids and token counts (rows the processor padded cut away, a newline row embedding after each
row), and batching and chunked prefill never change the answer."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from helpers.vlm_helpers import generated_tokens, hf_generate, image_prompt, make_tiny_llava_next, random_image

TEXT = "t5 t9 <image> t7 t33 t45"
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# (width, height): a 2 x 2 grid with padded rows, a wide 1 x 2 grid, a tall 2 x 1 grid
SHAPES = [(40, 48), (64, 20), (20, 70)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_llava_next(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=tiny[0], dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=512)


def test_pictures_of_every_shape_equal_transformers(tiny, llm) -> None:
    _, hf, processor = tiny
    images = [random_image(seed, shape) for seed, shape in enumerate(SHAPES, 1)]
    counts = {len(processor(text=TEXT, images=[image])["input_ids"][0]) for image in images}
    assert len(counts) == len(SHAPES)  # each shape has its own grid and token count
    refs = [hf_generate(hf, processor, TEXT, [image], MAX_TOKENS) for image in images]
    assert len({tuple(r) for r in refs}) > 1
    assert generated_tokens(llm, [image_prompt(TEXT, image) for image in images], GREEDY) == refs


def test_two_pictures_in_one_prompt_and_batched_requests_equal_transformers(tiny, llm) -> None:
    _, hf, processor = tiny
    text = "t5 <image> t9 <image> t7"
    pairs = [(random_image(10, SHAPES[1]), random_image(11, SHAPES[2])),
             (random_image(12, SHAPES[0]), random_image(10, SHAPES[1]))]
    refs = [hf_generate(hf, processor, text, list(pair), MAX_TOKENS) for pair in pairs]
    batched = generated_tokens(llm, [image_prompt(text, *pairs[i % 2]) for i in range(6)], GREEDY)
    assert batched == [refs[i % 2] for i in range(6)]


def test_chunked_prefill_through_grids_equals_transformers(tiny) -> None:
    """A step budget smaller than the prompt: chunks end inside the grids' tokens (their encoder outputs cached)."""
    path, hf, processor = tiny
    llm = LLM(model=path, dtype="float32", block_size=4, kv_cache_memory="4MiB", max_model_len=512,
              max_num_batched_tokens=80, enable_prefix_caching=False)
    images = [random_image(20, SHAPES[0]), random_image(21, SHAPES[2])]
    text = "t5 <image> t9 <image> t7"
    assert generated_tokens(llm, [image_prompt(text, *images)], GREEDY) == [
        hf_generate(hf, processor, text, images, MAX_TOKENS)]
    assert llm.engine.core.worker.runner.multimodal.num_encoded_images == 2
