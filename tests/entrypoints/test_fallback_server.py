"""A model without native code served through the transformers fallback: `pagedllm serve` (one server start)
answers completions, batched and streamed, with transformers' greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.fallback_configs import save_fallback_tiny

ARCH = "Starcoder2ForCausalLM"  # sliding window on every layer
MAX_TOKENS = 8

pytestmark = pytest.mark.slow  # starts a server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, remote_server_cls):
    path, hf = save_fallback_tiny(ARCH, tmp_path_factory.mktemp("starcoder2"))
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 6, 17)]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    server = remote_server_cls(["--model", path, "--served-model-name", "fallback", "--max-model-len", "256",
                           "--block-size", "8"])
    try:
        yield server, prompts, expected
    finally:
        server.stop()


def test_completions_through_the_fallback(served) -> None:
    server, prompts, expected = served
    assert "through the transformers fallback" in server.log_path.read_text()
    client = server.client()

    def complete(prompt: list[int]) -> str:
        return client.completions.create(model="fallback", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the engine batches them
        texts = list(pool.map(complete, prompts))
    assert [t.split() for t in texts] == [[f"t{i}" for i in ids] for ids in expected]
    stream = client.completions.create(model="fallback", prompt=prompts[2], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream).split() == [f"t{i}" for i in expected[2]]
