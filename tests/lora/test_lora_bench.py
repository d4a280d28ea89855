"""``pagedllm bench throughput / latency --num-lora-adapters N --lora-rank R``: requests spread over N random
adapters that every load and check like a user's PEFT folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.benchmarks.lora_adapters import random_adapters, spread
from pagedllm.entrypoints.cli.main import main
from pagedllm.lora.peft_checkpoint import load_peft_adapter
from pagedllm.lora.target_modules import base_module_shapes

from helpers.arch_configs import save_word_tokenizer
from helpers.model_helpers import make_tiny_llama, tiny_llama_config

SMALL_ENGINE = ["--kv-cache-memory", "16MiB", "--max-model-len", "128", "--disable-log-stats", "--dtype", "float32"]


def test_random_adapters_are_valid_peft_folders_spread_round_robin(tmp_path: Path) -> None:
    config = tiny_llama_config()
    adapters = random_adapters(config, 3, 4, root=str(tmp_path))
    shapes = base_module_shapes(config)
    loaded = [load_peft_adapter(a.lora_path, shapes, 4) for a in adapters]
    assert all(set(a.modules) == set(shapes) and a.max_rank == 4 for a in loaded)
    assert len({a.digest for a in loaded}) == 3
    assert [a.lora_int_id for a in spread(adapters, 5)] == [1, 2, 3, 1, 2]
    assert spread([], 5) is None


def test_bench_throughput_over_adapters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_llama(tmp_path / "m")
    save_word_tokenizer(model)
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", model, "--num-prompts", "6", "--input-len", "12", "--output-len",
               "4", "--num-lora-adapters", "3", "--lora-rank", "8", "--max-loras", "2", "--output-json", str(out),
               "--disable-tqdm", *SMALL_ENGINE])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["num_lora_adapters"] == 3 and result["max_loras"] == 2 and result["total_output_tokens"] == 24
    rc = main(["bench", "throughput", "--backend", "hf", "--model", model, "--num-lora-adapters", "2",
               "--num-prompts", "2", *SMALL_ENGINE])
    assert rc != 0 and "hf backend runs the base model only" in capsys.readouterr().err
