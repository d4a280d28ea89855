"""Vision-language throughput and the encoder cache's effect on time to first token, on a random-weight LLaVA of
SmolVLM-256M's size: a CLIP ViT-B/16 tower at 224 px (196 image tokens a picture) in front of SmolLM2-135M (the
default model's config and tokenizer, with an ``<image>`` token added).

    # images/s: 32 image+text requests, pagedllm vs transformers' batched generate, side by side
    python benchmarks/vision_throughput.py throughput --num-requests 32 --max-tokens 32
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

IMAGE_SIZE, PATCH = 224, 16
PROMPT = "Describe the picture.\n<image>\nIt shows"


def build_model(folder: Path, smoke: bool) -> Path:
    """A random LLaVA (CLIP ViT-B/16 + SmolLM2-135M's decoder) with the default model's tokenizer, as an HF folder."""
    import torch
    import transformers as tf
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from pagedllm.model_executor.loader.model_source import find_model_source

    source = find_model_source(None)
    gguf = Path(source.gguf_file).name
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=gguf)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = AutoConfig.from_pretrained(source.folder, gguf_file=gguf)
    text.vocab_size = len(tokenizer)
    vision = tf.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=12, image_size=IMAGE_SIZE, patch_size=PATCH)
    if smoke:
        text.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16))
        vision = tf.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    config = tf.LlavaConfig(vision_config=vision, text_config=text,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor = tf.LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def images(count: int, distinct: int) -> list:
    import numpy as np
    from PIL import Image

    pictures = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (IMAGE_SIZE + 32, IMAGE_SIZE + 48, 3),
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
    # Warm-up (kernels, first-step allocations) on other pictures: the timed ones are encoded in the timed run.
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in images(102, 102)[100:]], params,
                 use_tqdm=False)
    with gc_heap_frozen():
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        ours = time.perf_counter() - start
    del llm

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = tf.LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    processor = tf.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=[PROMPT] * args.num_requests, images=pictures, return_tensors="pt", padding=True)
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.inference_mode():
        model.generate(**{k: v[:2] for k, v in inputs.items()}, max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
        theirs = time.perf_counter() - start
    return {"requests": args.num_requests, "max_tokens": args.max_tokens, "dtype": args.dtype,
            "pagedllm_images_per_s": args.num_requests / ours, "transformers_images_per_s": args.num_requests / theirs,
            "speedup": theirs / ours}


def ttft(folder: Path, args: argparse.Namespace) -> dict:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine_args import EngineArgs
    from pagedllm.sampling_params import SamplingParams

    pictures = images(args.num_requests, 4)
    one_image_tokens = (IMAGE_SIZE // PATCH) ** 2
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
    results["ttft_ratio_no_reuse_over_cache"] = (results["no_reuse"]["median_ttft_ms"]
                                                 / results["encoder_cache"]["median_ttft_ms"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["throughput", "ttft"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model: checks the script, times nothing")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), args.smoke)
        result = throughput(folder, args) if args.mode == "throughput" else ttft(folder, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
