"""Vision-language throughput and the encoder cache's effect on time to first token, on random-weight models of
SmolVLM-256M's size, built from the default model's config and tokenizer (SmolLM2-135M, with image tokens added):

- ``--family smolvlm`` (default): Idefics3 with SmolVLM-256M's vision config (SigLIP-style, 768 wide, 12 layers,
  512 px tiles of 16 px patches, pixel shuffle 4: 64 tokens a tile); pictures of 384 x 448 px, which the processor
  (longest edge 512) does not split: one tile, 64 image tokens each.
- ``--family llava``: a CLIP ViT-B/16 at 224 px (196 image tokens a picture) in front of the same decoder.

    # images/s: 32 image+text requests, pagedllm vs transformers' batched generate, side by side; both in the
    # engine's default dtype (bfloat16 on a CPU with native bf16, else float32), or each named
    python benchmarks/vision_throughput.py throughput --num-requests 32 --max-tokens 32
    python benchmarks/vision_throughput.py throughput --num-requests 32 --max-tokens 32 --hf-dtype float32
    # time to first token on repeated images (4 pictures round-robin, one request at a time, prefix caching off):
    # the encoder cache (default size) vs a cache that holds one picture (every request encodes again)
    python benchmarks/vision_throughput.py ttft --num-requests 32

``--smoke`` shrinks the model to check the script itself in seconds. Results print as JSON (``--output-json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

IMAGE_SIZE, PATCH = 224, 16  # llava
TILE, TILE_PATCH, SHUFFLE = 512, 16, 4  # smolvlm (SmolVLM-256M's vision config)
PICTURE = (448, 384)  # width, height of the benchmark's pictures
PROMPT = "Describe the picture.\n<image>\nIt shows"


def _base(smoke: bool):
    """The default model's tokenizer (with the image tokens) and text config (shrunk for --smoke)."""
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.model_executor.loader.model_source import find_model_source

    source = find_model_source(None)
    gguf = Path(source.gguf_file).name
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=gguf)
    tags = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
            *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]
    tokenizer.add_special_tokens({"additional_special_tokens": tags})
    text = AutoConfig.from_pretrained(source.folder, gguf_file=gguf)
    text.vocab_size = len(tokenizer)
    if smoke:
        text.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16))
    return tokenizer, text


def build_model(folder: Path, family: str, smoke: bool) -> Path:
    """A random-weight model of ``family`` as an HF folder (weights, config, processor, tokenizer)."""
    import torch
    import transformers as tf

    tokenizer, text = _base(smoke)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    width = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4) if smoke else \
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    torch.manual_seed(0)
    if family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        vision = tf.CLIPVisionConfig(**width, image_size=IMAGE_SIZE, patch_size=PATCH)
        config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                                architectures=["LlavaForConditionalGeneration"])
        tf.LlavaForConditionalGeneration(config).save_pretrained(folder)
        processor = tf.LlavaProcessor(
            image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                                  crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
            tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        vision = tf.Idefics3VisionConfig(**width, image_size=TILE, patch_size=TILE_PATCH)
        config = tf.Idefics3Config(vision_config=vision, text_config=text, scale_factor=SHUFFLE,
                                   image_token_id=image_token_id, tie_word_embeddings=True,
                                   architectures=["Idefics3ForConditionalGeneration"])
        tf.Idefics3ForConditionalGeneration(config).save_pretrained(folder)
        processor = tf.Idefics3Processor(
            image_processor=Idefics3ImageProcessorPil(size={"longest_edge": TILE},
                                                      max_image_size={"longest_edge": TILE}, do_image_splitting=True),
            tokenizer=tokenizer, image_seq_len=(TILE // TILE_PATCH) ** 2 // SHUFFLE ** 2,
            chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def images(count: int, distinct: int) -> list:
    import numpy as np
    from PIL import Image

    pictures = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (PICTURE[1], PICTURE[0], 3),
                                                                  dtype=np.uint8)) for i in range(distinct)]
    return [pictures[i % distinct] for i in range(count)]


def throughput(folder: Path, args: argparse.Namespace) -> dict:
    import torch
    import transformers as tf

    from pagedllm import LLM, SamplingParams
    from pagedllm.utils import gc_heap_frozen

    pictures = images(args.num_requests, args.num_requests)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(model=str(folder), dtype=args.dtype, max_num_seqs=args.num_requests)
    ours_dtype = str(llm.engine.core.worker.runner.model.dtype).removeprefix("torch.")
    # Warm-up (kernels, first-step allocations) on other pictures: the timed ones are encoded in the timed run.
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in images(102, 102)[100:]], params,
                 use_tqdm=False)
    with gc_heap_frozen():
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        ours = time.perf_counter() - start
    del llm

    hf_dtype = args.hf_dtype or ours_dtype
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[hf_dtype]
    model = tf.AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).eval()
    processor = tf.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    batch_images = pictures if args.family == "llava" else [[p] for p in pictures]
    inputs = processor(text=[PROMPT] * args.num_requests, images=batch_images, return_tensors="pt", padding=True)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in inputs.items()}, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
        theirs = time.perf_counter() - start
    return {"family": args.family, "requests": args.num_requests, "max_tokens": args.max_tokens, "dtype": ours_dtype,
            "transformers_dtype": hf_dtype,
            "pagedllm_images_per_s": args.num_requests / ours, "transformers_images_per_s": args.num_requests / theirs,
            "speedup": theirs / ours}


def ttft(folder: Path, args: argparse.Namespace) -> dict:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_args import EngineArgs
    from pagedllm.sampling_params import SamplingParams

    pictures = images(args.num_requests, 4)
    if args.family == "llava":
        one_image_tokens = (IMAGE_SIZE // PATCH) ** 2
    else:  # one tile: the pictures fit the longest edge unsplit
        one_image_tokens = (TILE // TILE_PATCH) ** 2 // SHUFFLE ** 2
    results = {}
    for label, cache_size in (("encoder_cache", 0), ("no_reuse", one_image_tokens)):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(folder), dtype=args.dtype,
                                                       enable_prefix_caching=False, encoder_cache_size=cache_size))
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        times = []
        for i, picture in enumerate([pictures[0]] + pictures):  # the first one warms up
            start = time.perf_counter()
            engine.add_request(f"r{i}", {"prompt": PROMPT, "multi_modal_data": {"image": picture}}, params)
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - start)
        encoded = engine.core.worker.runner.multimodal.num_encoded_images
        results[label] = {"median_ttft_ms": 1000 * statistics.median(times[1:]), "images_encoded": encoded,
                          "encoder_cache_size": cache_size or "default"}
        engine.core.close()
    results["family"] = args.family
    results["ttft_ratio_no_reuse_over_cache"] = (results["no_reuse"]["median_ttft_ms"]
                                                 / results["encoder_cache"]["median_ttft_ms"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["throughput", "ttft"])
    parser.add_argument("--family", default="smolvlm", choices=["smolvlm", "llava"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="pagedllm's dtype (auto: bfloat16 on a CPU with native bf16, else float32)")
    parser.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16"],
                        help="transformers' dtype in the throughput run (default: the one pagedllm resolved)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model: checks the script, times nothing")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), args.family, args.smoke)
        result = throughput(folder, args) if args.mode == "throughput" else ttft(folder, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
