"""On a GPU the sampler must run without host syncs: the engine's one sync is the ``tolist()`` that returns the
tokens. Checked on the CPU with the paths a CUDA tensor takes (no C++ draw, no xgrammar CPU apply) while a
dispatch mode watches for ops that read tensor values on the host or lift host data."""

from __future__ import annotations

import pytest
import torch

from pagedllm.platforms import platform_for
from pagedllm.sample.batch_state import build_sampling_metadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams

from helpers.host_reads import HostReads

VOCAB = 300
CASES = {
    "greedy": [SamplingParams(temperature=0.0)] * 3,
    "random with a grammar": [SamplingParams(temperature=0.8)] * 3,
    "mixed, top-k, top-p, min-p": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
                                   SamplingParams(temperature=1.0, min_p=0.1, top_p=0.5)],
    "penalties, bias, min_tokens, logprobs": [
        SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.2,
                       logit_bias={3: 5.0}, min_tokens=4, logprobs=3, stop_token_ids=[7])] * 2,
    "seeded and unseeded": [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.9)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampler_reads_nothing_on_the_host(name: str, monkeypatch) -> None:
    cpu = platform_for("cpu")  # what a CUDA tensor gets: no C++ draw, no xgrammar CPU loop
    monkeypatch.setattr(cpu, "cpu_kernels", lambda dtype, dtypes=(torch.float32,): None)
    monkeypatch.setattr(cpu, "grammar_bitmask_apply", lambda dtype: None)
    params = CASES[name]
    rows = len(params)
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    grammar_rows = [0, 2] if "grammar" in name else []
    bitmask = torch.full((len(grammar_rows), (VOCAB + 31) // 32), -1, dtype=torch.int32) if grammar_rows else None
    meta = build_sampling_metadata(params, [[1, 2]] * rows, [[3, 4, 5]] * rows, generators, [2], VOCAB,
                                   torch.device("cpu"), grammar_rows, bitmask)
    torch.manual_seed(0)
    logits = torch.randn(rows, VOCAB)
    with torch.inference_mode(), HostReads() as watch:
        out = Sampler()(logits, meta)
    assert watch.seen == []
    assert out.sampled_token_ids.shape == (rows,)
