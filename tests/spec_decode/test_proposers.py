"""The proposer interface and its three implementations; which requests may speculate."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.model_executor.layers.attention import attention_step, bind_kv_caches, step_readers
from pagedllm.model_executor.layers.rotary_embedding import RopeStep
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import parse_speculative_config
from pagedllm.spec_decode.model_drafter import (
    ModelDrafter,
    layer_skip_forward,
    make_draft_model_drafter,
    make_layer_skip_drafter,
)
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.proposer import DraftJob, Proposer
from pagedllm.spec_decode.spec_decoder import SpecDecoder, can_speculate
from pagedllm.structured_output.params import StructuredOutputsParams

from helpers.host_reads import HostReads
from helpers.model_helpers import make_model_kv_caches, tiny_llama_config

CPU = torch.device("cpu")


class _ReadsRecorded:
    """SamplingParams that note every attribute read (getattr with a default would hide a misspelt one)."""

    def __init__(self, params: SamplingParams) -> None:
        self._params, self.read = params, []

    def __getattr__(self, name: str):
        self.read.append(name)
        return getattr(self._params, name)


def test_can_speculate_reads_only_real_sampling_params_fields() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for params in (SamplingParams(), SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))):
        recorded = _ReadsRecorded(params)
        can_speculate(recorded)
        assert recorded.read and set(recorded.read) <= fields, recorded.read
    assert can_speculate(SamplingParams(temperature=0.7, logprobs=2, logit_bias={1: 1.0}, min_tokens=3))
    assert not can_speculate(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))


# ---- a stateless fake model, element-wise only (so a row's logits do not depend on the batch) -------------
V, H = 40, 2
_g = torch.Generator().manual_seed(0)
E, P, W = torch.randn(V, H, generator=_g), torch.randn(64, H, generator=_g) * 0.3, torch.randn(H, V, generator=_g)


def _fake_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return E[input_ids] + P[positions]


def _fake_logits(hidden: torch.Tensor) -> torch.Tensor:
    return 3.0 * hidden[:, :1] * W[0] + hidden[:, 1:] * W[1]


def _reference_drafts(job: DraftJob) -> tuple[list[int], list[torch.Tensor]]:
    """One request drafted one token at a time with its own float64 uniforms (the drafter before batching)."""
    token, position, drafts, probs = job.token_ids[job.end - 1], job.end - 1, [], []
    for _ in range(job.num_drafts):
        logits = _fake_logits(_fake_forward(torch.tensor([token]), torch.tensor([position])))[0]
        if job.temperature < 1e-5:
            token = int(logits.argmax())
        else:
            p = (logits / job.temperature).softmax(dim=0)
            cdf = p.double().cumsum(0)
            u = torch.rand(1, generator=job.generator, dtype=torch.float64)
            token = int(torch.searchsorted(cdf, (1.0 - u) * cdf[-1]).clamp_(max=V - 1))
            probs.append(p)
        drafts.append(token)
        position += 1
    return drafts, probs


def _jobs() -> list[DraftJob]:
    def job(rid, tokens, start, num, temperature, seed):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        return DraftJob(rid, tokens, [1, 2], start, len(tokens), num, temperature, gen)

    return [job("prefill", [3, 5, 7, 9, 11], 0, 3, 0.8, 1), job("greedy", [1, 2, 3], 2, 4, 0.0, None),
            job("seeded", [4, 4, 4, 4], 3, 2, 1.3, 2), job("catch-up only", [6, 7], 1, 0, 0.9, 3),
            job("one", [8, 9, 10], 2, 1, 0.5, 4)]


def test_model_drafter_matches_one_token_at_a_time_and_reads_the_host_once(monkeypatch) -> None:
    drafter = ModelDrafter(_fake_forward, _fake_logits, block_size=16, device=CPU)
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: transfers.append(t.shape) or tolist(t))
    with HostReads() as watch:
        proposals = drafter.propose_batch(_jobs())
    assert [op for op in watch.seen if "lift_fresh" not in op] == []
    assert len(transfers) == 1  # every draft of the step in one read
    monkeypatch.undo()
    for job in _jobs():
        drafts, probs = _reference_drafts(job)
        if job.num_drafts == 0:
            assert job.req_id not in proposals.drafts
            continue
        assert proposals.drafts[job.req_id] == drafts, job.req_id
        if probs:
            assert torch.equal(proposals.probs[job.req_id], torch.stack(probs))
        else:
            assert job.req_id not in proposals.probs


@pytest.fixture(scope="module")
def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4), torch.float32)
    bind_kv_caches(model, make_model_kv_caches(model, 4, 16))
    return model


def test_layer_skip_runs_the_models_own_forward_over_its_first_layers(tiny_target: LlamaForCausalLM) -> None:
    inner = tiny_target.model
    ids, positions = torch.tensor([1, 7, 30, 4, 99, 5]), torch.arange(6)
    meta = build_attention_metadata([6], [6], [[1]], 16)
    with torch.inference_mode(), attention_step(meta, step_readers(tiny_target)):
        got = layer_skip_forward(tiny_target, 2)(ids, positions)
        # What layer skip carried before: the Llama forward written out over the first two layers.
        x, rope, residual = inner.embed_tokens(ids), RopeStep(inner.rotary_emb, positions), None
        for layer in inner.layers[:2]:
            x, residual = layer(x, residual, rope)
        expected, _ = inner.norm(x, residual)
        full = tiny_target(ids, positions)
        assert torch.equal(inner(ids, positions, num_layers=4), full)
    assert torch.equal(got, expected)
    assert not torch.allclose(got, full)


def test_layer_skip_refuses_a_stack_without_a_layer_range() -> None:
    class Stack(nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return input_ids

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Stack()

    with pytest.raises(ValueError, match="layer_skip needs a Llama-style model"):
        layer_skip_forward(Model(), 1)


def test_every_method_is_a_proposer(tiny_target: LlamaForCausalLM) -> None:
    ngram = NgramProposer(k=3, min_n=1, max_n=2)
    draft = make_draft_model_drafter(tiny_target, 16, CPU)
    skip = make_layer_skip_drafter(tiny_target, 2, 16, CPU)
    assert all(isinstance(p, Proposer) for p in (ngram, draft, skip))
    assert (ngram.writes_kv, draft.writes_kv, skip.writes_kv) == (False, True, True)
    assert (ngram.catches_up_all, draft.catches_up_all, skip.catches_up_all) == (False, True, False)
    jobs = [DraftJob("a", [1, 2, 3, 1, 2], [1], 5, 5, 3, 0.0, None), DraftJob("b", [4, 5, 6], [2], 3, 3, 2, 0.0, None)]
    assert ngram.propose_batch(jobs).drafts == {"a": [3, 1, 2], "b": []}
    for method, cls in (("ngram", NgramProposer), ("layer_skip", ModelDrafter)):
        cfg = parse_speculative_config({"method": method, "num_speculative_tokens": 2, "num_draft_layers": 2}
                                       if method == "layer_skip" else {"method": method, "num_speculative_tokens": 2})
        assert isinstance(SpecDecoder(cfg, tiny_target, None, 16, CPU).proposer, cls)
