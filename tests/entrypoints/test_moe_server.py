"""One MoE model (a tiny random Qwen2-MoE: 8 experts, top-4, a shared expert) through ``pagedllm serve``: greedy
completions of a batch of prompts equal transformers' ``generate``."""

from __future__ import annotations

import pytest
import torch

from helpers.moe_configs import save_tiny_moe

PROMPTS = [[5, 17, 33, 40, 9], [100, 7, 12, 200, 42, 13, 77, 8, 19, 60, 61]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_server(remote_server_cls, tmp_path_factory):
    path, hf = save_tiny_moe("qwen2moe-e8-top4-shared", tmp_path_factory.mktemp("moe"))
    server = remote_server_cls([path, "--served-model-name", "tiny-moe", "--max-model-len", "128"])
    try:
        yield server, hf
    finally:
        server.stop()


def _hf_continuation(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow  # one server start: ~45 s on 2 busy cores
def test_completions_of_a_moe_equal_transformers(moe_server) -> None:
    server, hf = moe_server
    client = server.client()
    resp = client.completions.create(model="tiny-moe", prompt=PROMPTS, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    by_index = sorted(resp.choices, key=lambda c: c.index)
    for prompt, choice in zip(PROMPTS, by_index, strict=True):
        want = " ".join(f"t{i}" for i in _hf_continuation(hf, prompt))
        assert choice.text.split() == want.split()
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
