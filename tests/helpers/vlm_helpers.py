"""Tiny random-weight LLaVA models with their processors (saved as HF folders the engine loads), test images,
and transformers' greedy output as the reference."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

TEXT_VOCAB = 256  # word tokens t0 .. t255; the image token is the next id
IMAGE_TOKEN_ID = TEXT_VOCAB
IMAGE_SIZE, PATCH = 32, 8  # 16 patches: 16 image tokens a picture
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
# Content parts: text parts as they are, an image as <image>; roles are dropped (a word-level vocabulary).
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} "
                 "{% endif %}{% endfor %}{% endif %}{% endfor %}")


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{f"t{i}": i for i in range(TEXT_VOCAB)}, "<image>": IMAGE_TOKEN_ID}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t0", extra_special_tokens={"image_token": "<image>"})


def _random_weights(model: Any, is_norm: Callable[[str], bool] = lambda name: "norm" in name,
                    norm_mean: Callable[[str], float] = lambda name: 1.0) -> None:
    """Matrices at std 0.08 (so images and tokens move the logits), norm weights near ``norm_mean``, the rest
    small."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif is_norm(name):
                p.normal_(norm_mean(name), 0.1)
            else:
                p.normal_(0.0, 0.05)


def tiny_llava_config(**text_overrides: Any) -> Any:
    import transformers as tf

    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = tf.LlamaConfig(**{**dict(vocab_size=TEXT_VOCAB + 8, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                    tie_word_embeddings=False), **text_overrides})
    return tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                          architectures=["LlavaForConditionalGeneration"])


def make_tiny_llava(path: str | os.PathLike, seed: int = 0) -> tuple[str, Any, Any]:
    """Save a random tiny LLaVA (weights at std 0.08, so images and tokens move the logits) and its processor
    to ``path``; returns (path, transformers model, processor)."""
    import transformers as tf
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(tiny_llava_config()).eval()
    _random_weights(model)
    model.save_pretrained(str(path))
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=_tokenizer(), patch_size=PATCH,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    processor.tokenizer.save_pretrained(str(path))
    return str(path), model, processor


def make_tiny_llava_next(path: str | os.PathLike, seed: int = 0) -> tuple[str, Any, Any]:
    """Save a random tiny LLaVA-NeXT (the tiny LLaVA's tower and decoder; grids of 32 px tiles up to 2 x 2, so a
    40 x 48 picture takes the 64 x 64 grid: 4 tiles + the base one, its padded rows cut) and its processor."""
    import transformers as tf
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    llava = tiny_llava_config()
    pinpoints = [[32, 64], [64, 32], [64, 64]]
    config = tf.LlavaNextConfig(vision_config=llava.vision_config.to_dict(), text_config=llava.text_config.to_dict(),
                                image_token_id=IMAGE_TOKEN_ID, image_grid_pinpoints=pinpoints,
                                architectures=["LlavaNextForConditionalGeneration"])
    torch.manual_seed(seed)
    model = tf.LlavaNextForConditionalGeneration(config).eval()
    _random_weights(model)
    with torch.no_grad():
        model.model.image_newline.normal_(0.0, 0.5)  # its rows must move the answer
    model.save_pretrained(str(path))
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                 image_grid_pinpoints=pinpoints)
    processor = tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=_tokenizer(), patch_size=PATCH,
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                      chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    processor.tokenizer.save_pretrained(str(path))
    return str(path), model, processor


def random_image(seed: int, size: tuple[int, int] = (40, 48)) -> Any:
    """A random RGB picture (PIL), different for each seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png_data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_prompt(text: str, *images: Any) -> dict:
    """An offline prompt with ``images`` for ``text``'s placeholders, as vLLM takes it."""
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def generated_tokens(llm: Any, prompts: list, params: Any) -> list[list[int]]:
    """Each prompt's generated token ids from ``llm.generate``."""
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def encoded_images(llm: Any) -> int:
    """Vision encoder runs of ``llm``'s engine so far (one per image)."""
    return llm.engine.core.worker.runner.multimodal.num_encoded_images


def hf_generate(model: Any, processor: Any, text: str, images: list | None, max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` on the processor's inputs; the new token ids."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ---- Idefics3 / SmolVLM ----------------------------------------------------------------------------------------
IDEFICS_TILE, IDEFICS_PATCH, IDEFICS_SCALE = 32, 8, 2  # (32/8)^2 / 2^2 = 4 image tokens a tile
IDEFICS_TAGS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]


def _idefics_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TEXT_VOCAB)}
    for token in ["<image>", *IDEFICS_TAGS]:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2",
                                  pad_token="t0")
    tok.add_special_tokens({"additional_special_tokens": ["<image>", *IDEFICS_TAGS]})  # split out of any word
    return tok


def make_tiny_idefics3(path: str | os.PathLike, seed: int = 0) -> tuple[str, Any, Any]:
    """Save a random tiny Idefics3 (SmolVLM's design: SigLIP tiles, pixel shuffle, Llama text) and its processor
    (image splitting on: a 40 x 48 picture becomes 2 x 2 tiles + the whole, 20 image tokens)."""
    import transformers as tf
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _idefics_tokenizer()
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=IDEFICS_TILE, patch_size=IDEFICS_PATCH)
    text = tf.LlamaConfig(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)
    config = tf.Idefics3Config(vision_config=vision, text_config=text, scale_factor=IDEFICS_SCALE,
                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                               architectures=["Idefics3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(config).eval()
    _random_weights(model)
    model.save_pretrained(str(path))
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * IDEFICS_TILE},
                                                max_image_size={"longest_edge": IDEFICS_TILE}, do_image_splitting=True)
    seq_len = (IDEFICS_TILE // IDEFICS_PATCH) ** 2 // IDEFICS_SCALE ** 2
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len,
                                     chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(str(path))
    processor.tokenizer.save_pretrained(str(path))
    return str(path), model, processor


# ---- Qwen2-VL ----------------------------------------------------------------------------------------------------
QWEN_TAGS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # where an image goes in a raw prompt


def _qwen2_vl_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TEXT_VOCAB)}
    for token in QWEN_TAGS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2",
                                  pad_token="t0")
    tok.add_special_tokens({"additional_special_tokens": QWEN_TAGS})  # split out of any word
    return tok


def make_tiny_qwen2_vl(path: str | os.PathLike, seed: int = 0, version: str = "2") -> tuple[str, Any, Any]:
    """Save a random tiny Qwen2-VL (2D-rotary ViT with 8 px patches, merge 2; Qwen2 text with M-RoPE sections
    [2, 3, 3] of its 8 rotary frequencies) and its processor (dynamic resolution: a picture keeps roughly its
    size, rounded to 16 px, between 16 x 16 and 64 x 64 px worth of pixels). ``version`` "2.5": Qwen2.5-VL's
    ViT (RMSNorm, gated SiLU MLP, windows of 32 px = 2 x 2 merge blocks; layer 1 of 3 attends whole images)."""
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _qwen2_vl_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TAGS}
    text = dict(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, hidden_size=64, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config_class, model_class = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    if version == "2.5":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=32,
                      fullatt_block_indexes=[1], hidden_act="silu")
        config_class, model_class = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
                              architectures=[model_class.__name__])
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _random_weights(model, is_norm=lambda name: "norm" in name or "ln_q" in name)  # LayerNorm and RMSNorm
    model.save_pretrained(str(path))
    image_processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                               size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    # transformers' Qwen2VLProcessor cannot be built without torchvision (its video half): the folder holds the
    # image processor and the tokenizer, as a checkpoint's files do.
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", QWEN_IMAGE)
    image_processor.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path), model, (image_processor, tokenizer)


def qwen2_vl_inputs(processor: tuple[Any, Any], text: str, images: list | None) -> dict[str, torch.Tensor]:
    """transformers' model inputs for ``text`` (one QWEN_IMAGE per image) as Qwen2VLProcessor makes them: each
    <|image_pad|> repeated grid_t * grid_h * grid_w / merge^2 times, mm_token_type_ids 1 on those."""
    image_processor, tokenizer = processor
    out: dict[str, torch.Tensor] = {}
    if images:
        out.update(image_processor(images=images, return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        counts = (out["image_grid_thw"].prod(dim=1) // 4).tolist()
        text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    enc = tokenizer(text, return_tensors="pt")
    out["input_ids"], out["attention_mask"] = enc["input_ids"], enc["attention_mask"]
    out["mm_token_type_ids"] = (enc["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    return out


def qwen2_vl_generate(model: Any, processor: tuple[Any, Any], text: str, images: list | None,
                      max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for a Qwen2-VL prompt; the new token ids."""
    inputs = qwen2_vl_inputs(processor, text, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ---- Gemma 3 (multimodal) ----------------------------------------------------------------------------------------
GEMMA3_TAGS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_IMAGE_TOKENS = 16  # a 32 px picture: 8 x 8 patches of 4 px, pooled 2 x 2


def _gemma3_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TEXT_VOCAB)}
    for token in GEMMA3_TAGS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t0", extra_special_tokens={"boi_token": "<start_of_image>",
                                                                         "eoi_token": "<end_of_image>",
                                                                         "image_token": "<image_soft_token>"})


def make_tiny_gemma3_mm(path: str | os.PathLike, seed: int = 0, tie_word_embeddings: bool = False
                        ) -> tuple[str, Any, Any]:
    """Save a random tiny Gemma 3 multimodal model (SigLIP tower, 2 x 2 average pool to 16 image tokens; text
    layers sliding (window 8) / full / sliding, so a window cuts into the image run) and its processor (prompts put
    <start_of_image> where a picture goes)."""
    import transformers as tf
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = _gemma3_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_TAGS}
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=32, patch_size=4)
    text = tf.Gemma3TextConfig(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=16,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, image_token_id=ids["<image_soft_token>"],
                             boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                             tie_word_embeddings=tie_word_embeddings, architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    # Gemma's RMSNorms scale by (1 + w), SigLIP's LayerNorms by w.
    _random_weights(model, norm_mean=lambda name: 1.0 if "layer_norm" in name or "post_layernorm" in name else 0.0)
    with torch.no_grad():
        # A strong patch embedding, so that pictures of random pixels differ to the model.
        model.model.vision_tower.embeddings.patch_embedding.weight.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    processor = tf.Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                   tokenizer=tokenizer, image_seq_length=GEMMA3_IMAGE_TOKENS,
                                   chat_template=CHAT_TEMPLATE.replace("<image>", "<start_of_image>"))
    processor.save_pretrained(str(path))
    processor.tokenizer.save_pretrained(str(path))
    return str(path), model, processor
