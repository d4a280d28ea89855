"""Embedding throughput: ``pagedllm bench embed``.

Embeds the same sentences with pagedllm's pooling runner (``LLM.embed``: continuous batching by tokens, no
padding) and with plain transformers the way sentence-transformers does it (sort by length, static batches
padded to the longest, mean pooling under the attention mask, L2 normalisation), side by side in one process
with the same threads. Reports sentences/s and tokens/s of each, the speedups, and the smallest cosine
between the two backends' vectors (a correctness check on the timed run itself).

Dtypes, so that both comparisons are visible: pagedllm runs its default (``--dtype auto``: bfloat16 on CPUs
with AVX-512 bf16 and on GPUs, else float32) or what ``--dtype`` says; the transformers baseline always runs
its own default, float32 (``speedup``: defaults vs defaults), and, when pagedllm's dtype differs, also in
pagedllm's dtype (``speedup_same_dtype``). The cosine is taken against the float32 baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from typing import Any

from pagedllm.engine_args import EngineArgs

_WORDS = (
    "the of and to in is was for on that with as by at from his her an it were which are this be or has had "
    "not but also first new after one two their its who been more people time city world year school music "
    "river water light market model language system data energy history science family game team film book "
    "president government university company village station church war army ship road power field season "
    "quick brown fox lazy dog learning network vector search query answer question cooking recipe weather "
    "mountain ocean island forest garden computer software engine memory paper theory planet star moon sun"
).split()


def make_sentences(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """Deterministic pseudo-sentences of varied length (``min_words``..``max_words`` words)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--num-sentences", type=int, default=1000, help="Sentences to embed (default: 1000).")
    parser.add_argument("--min-words", type=int, default=4, help="Shortest sentence in words (default: 4).")
    parser.add_argument("--max-words", type=int, default=60, help="Longest sentence in words (default: 60).")
    parser.add_argument("--backend", choices=["both", "pagedllm", "hf"], default="both",
                        help="both: pagedllm and transformers side by side (default); or only one.")
    parser.add_argument("--hf-batch-size", type=int, default=32,
                        help="Static batch size of the transformers baseline (sentence-transformers' default: 32).")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="Skip the untimed warm-up.")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(runner="pooling")
    return parser


def run_pagedllm(llm: Any, sentences: list[str], warmup: bool) -> dict[str, Any]:
    if warmup:
        llm.embed(sentences[:16], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.embed(sentences, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = {"elapsed_time": elapsed, "sentences_per_second": len(sentences) / elapsed,
              "tokens_per_second": tokens / elapsed, "total_tokens": tokens}
    return result | {"_vectors": [o.outputs.embedding for o in outs]}


def run_transformers(path: str, dtype: str, sentences: list[str], batch_size: int, max_len: int,
                     warmup: bool) -> dict[str, Any]:
    """sentence-transformers' encode() with AutoModel: length-sorted batches, masked mean, normalise."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def encode(texts: list[str]) -> tuple[list[torch.Tensor], int]:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        vectors: list[torch.Tensor | None] = [None] * len(texts)
        tokens = 0
        with torch.inference_mode():
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=max_len,
                          return_tensors="pt")
                tokens += int(enc["attention_mask"].sum())
                hidden = model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = F.normalize(((hidden * mask).sum(1) / mask.sum(1)).float(), dim=-1)
                for j, i in enumerate(idx):
                    vectors[i] = pooled[j]
        return vectors, tokens

    if warmup:
        encode(sentences[:16])
    start = time.perf_counter()
    vectors, tokens = encode(sentences)
    elapsed = time.perf_counter() - start
    return {"elapsed_time": elapsed, "sentences_per_second": len(sentences) / elapsed,
            "tokens_per_second": tokens / elapsed, "total_tokens": tokens, "_vectors": vectors}


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedllm import LLM

    if args.runner != "pooling":
        raise ValueError("runner: bench embed needs --runner pooling")
    engine_args = EngineArgs.from_cli_args(args)  # no --model: DEFAULT_POOLING_MODEL
    sentences = make_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    # The engine is built even for --backend hf: it resolves the model folder, max length and threads.
    llm = LLM(**dataclasses.asdict(engine_args))
    mc = llm.engine.config.model
    result: dict[str, Any] = {"model": mc.model_path, "dtype": mc.dtype, "baseline_dtype": "float32",
                              "num_sentences": len(sentences), "threads": torch.get_num_threads(),
                              "hf_batch_size": args.hf_batch_size,
                              "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens}
    print(f"pagedllm dtype {mc.dtype}; transformers baseline float32 (its default)"
          + (f" and {mc.dtype} (same dtype)" if mc.dtype != "float32" else ""))
    if args.backend in ("both", "pagedllm"):
        result["pagedllm"] = run_pagedllm(llm, sentences, args.warmup)
    if args.backend in ("both", "hf"):
        result["transformers"] = run_transformers(mc.model_path, "float32", sentences, args.hf_batch_size,
                                                  mc.max_model_len, args.warmup)
        if mc.dtype != "float32":
            result[f"transformers_{mc.dtype}"] = run_transformers(mc.model_path, mc.dtype, sentences,
                                                                  args.hf_batch_size, mc.max_model_len, args.warmup)
    if args.backend == "both":
        ours, ref = result["pagedllm"], result["transformers"]
        result["speedup"] = ours["sentences_per_second"] / ref["sentences_per_second"]
        same = result.get(f"transformers_{mc.dtype}", ref)
        result["speedup_same_dtype"] = ours["sentences_per_second"] / same["sentences_per_second"]
        cos = torch.nn.functional.cosine_similarity(torch.tensor(ours["_vectors"]), torch.stack(ref["_vectors"]))
        result["min_cosine"] = float(cos.min())
    for key in ("pagedllm", "transformers", f"transformers_{mc.dtype}"):
        if key in result:
            result[key].pop("_vectors")
            dtype = mc.dtype if key != "transformers" else "float32"
            print(f"{key.split('_')[0]:>12} ({dtype:>8}): {result[key]['sentences_per_second']:.1f} sentences/s, "
                  f"{result[key]['tokens_per_second']:.0f} tokens/s ({result[key]['elapsed_time']:.2f} s)")
    if "speedup" in result:
        print(f"speedup {result['speedup']:.2f}x vs the float32 baseline (defaults vs defaults), "
              f"{result['speedup_same_dtype']:.2f}x vs the baseline in {mc.dtype}; "
              f"min cosine vs the float32 baseline {result['min_cosine']:.6f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
