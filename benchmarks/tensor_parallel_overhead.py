"""What tensor parallelism costs on this host: per-step time of TP=2 vs TP=1, the step broadcast (encode + send)
per step, the all-reduce per call, and the start-up of mp vs Ray (TP=2 ranks; DP=2 engine cores).

    PYTHONPATH=. python benchmarks/tensor_parallel_overhead.py [--ray]

The model is random-weight, of the default model's size (SmolLM2-135M: hidden 576, 30 layers, ffn 1536) but with
8 heads / 2 KV heads, which TP=2 divides (SmolLM2's 9 / 3 do not). Numbers go to docs/distributed.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def smollm_shaped(root: Path) -> str:
    import torch
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.arch_configs import save_word_tokenizer

    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(root))
    save_word_tokenizer(root, 49152)
    return str(root)


def run(model: str, tp: int, backend: str | None = None) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.distributed import parallel_state

    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, distributed_executor_backend=backend, kv_cache_memory="256MiB",
              max_model_len=512, dtype="float32")
    startup = time.perf_counter() - start
    core = llm.engine.core
    prompts = [{"prompt_token_ids": [(7 * i + j) % 40000 + 3 for j in range(64)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    parallel_state.time_collectives(True)
    for key in parallel_state.COLLECTIVE_STATS:
        parallel_state.COLLECTIVE_STATS[key] = 0 if key.endswith("calls") else 0.0
    pub = getattr(core.worker, "publisher", None)
    enc0, n0 = (pub.encode_s, pub.num_steps) if pub else (0.0, 0)
    steps0 = core.num_steps
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = core.num_steps - steps0
    stats = dict(parallel_state.COLLECTIVE_STATS)
    parallel_state.time_collectives(False)
    out = {"tp": tp, "backend": backend or ("uni" if tp == 1 else "mp"), "startup_s": startup,
           "ranks_ready_s": getattr(core.worker, "startup_s", None), "steps": steps,
           "ms_per_step": 1000 * elapsed / steps}
    if pub:
        out["broadcast_ms_per_step"] = 1000 * (pub.encode_s - enc0) / (pub.num_steps - n0)
    if stats["all_reduce_calls"]:
        out["all_reduce_ms_per_call"] = 1000 * stats["all_reduce_s"] / stats["all_reduce_calls"]
        out["all_reduces_per_step"] = stats["all_reduce_calls"] / steps
        out["all_gather_ms_per_call"] = 1000 * stats["all_gather_s"] / max(stats["all_gather_calls"], 1)
    core.close()
    return out


def dp_startup(model: str, backend: str) -> float:
    from pagedllm.engine.mp_engine import MultiprocEngine
    from pagedllm.engine_args import EngineArgs

    config = EngineArgs(model=model, kv_cache_memory="64MiB", max_model_len=512, dtype="float32",
                        data_parallel_size=2, data_parallel_backend=backend).create_engine_config()
    start = time.perf_counter()
    engine = MultiprocEngine(config)
    took = time.perf_counter() - start
    engine.client.shutdown()
    engine.router.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ray", action="store_true", help="also time the Ray executor and Ray DP engines")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = smollm_shaped(Path(tmp) / "smollm-shaped")
        rows = [run(model, 1), run(model, 2)]
        if args.ray:
            import ray

            t = time.perf_counter()
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            print(f"ray.init(num_cpus=2): {time.perf_counter() - t:.1f} s")
            rows.append(run(model, 2, "ray"))
            print(f"DP=2 start-up: mp {dp_startup(model, 'mp'):.1f} s, ray {dp_startup(model, 'ray'):.1f} s")
        for row in rows:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
