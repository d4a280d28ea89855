"""``pagedllm bench embed`` at a tiny size: both backends run, agree, and the JSON has the numbers."""

from __future__ import annotations

import json

import pytest

from pagedllm.benchmarks.embed import make_sentences
from pagedllm.entrypoints.cli.main import main


def test_make_sentences_is_seeded_and_varied():
    a, b = make_sentences(20, 3, 9, seed=1), make_sentences(20, 3, 9, seed=1)
    assert a == b and a != make_sentences(20, 3, 9, seed=2)
    assert all(3 <= len(s.split()) <= 9 for s in a)


@pytest.mark.slow  # the real all-MiniLM-L6-v2 and transformers, like each test marked slow below
def test_bench_embed_dry_run(tmp_path, minilm_path):
    out = tmp_path / "embed.json"
    rc = main(["bench", "embed", "--model", minilm_path, "--num-sentences", "12", "--output-json", str(out),
               "--no-warmup", "--disable-log-stats", "--dtype", "float32"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["num_sentences"] == 12 and result["dtype"] == "float32" and result["baseline_dtype"] == "float32"
    for backend in ("pagedllm", "transformers"):
        assert result[backend]["sentences_per_second"] > 0
    assert "transformers_float32" not in result  # one baseline when the dtypes agree
    assert result["pagedllm"]["total_tokens"] == result["transformers"]["total_tokens"]
    assert result["min_cosine"] > 0.9999
    assert result["speedup"] > 0 and result["speedup_same_dtype"] == result["speedup"]


@pytest.mark.slow
def test_bench_embed_bf16_reports_both_baselines(tmp_path, minilm_path):
    """pagedllm in bf16: the float32 baseline (defaults vs defaults) and a bf16 one (same dtype) side by side."""
    out = tmp_path / "embed.json"
    rc = main(["bench", "embed", "--model", minilm_path, "--num-sentences", "8", "--output-json", str(out),
               "--no-warmup", "--disable-log-stats", "--dtype", "bfloat16"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and result["baseline_dtype"] == "float32"
    for backend in ("pagedllm", "transformers", "transformers_bfloat16"):
        assert result[backend]["sentences_per_second"] > 0
    assert result["transformers_bfloat16"]["total_tokens"] == result["pagedllm"]["total_tokens"]
    ratio = result["pagedllm"]["sentences_per_second"] / result["transformers_bfloat16"]["sentences_per_second"]
    assert abs(result["speedup_same_dtype"] - ratio) < 1e-9
    assert result["min_cosine"] > 0.9999  # against the float32 baseline
