"""Each attention backend builds its per-step state through one hook (``AttentionBackend.build_state``), kept under
its state class: the model runner has it built once per eager step, before the first layer, and so does every
other caller that builds metadata and runs layers over it (the drafter, Whisper's encoder); a forward over
metadata nobody prepared raises instead of building anything."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backends import torch_sdpa
from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.torch_encoder import encoder_plan
from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend, plan_step, step_plan
from pagedllm.attention.backends.torch_state import TorchStepState
from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend
from pagedllm.attention.forward_context import forward_context
from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata, link_groups
from pagedllm.attention.spec import AttentionSpec
from pagedllm.config import ModelConfig
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.model_executor.layers.attention import (
    Attention,
    attention_layers,
    bind_kv_caches,
    prepare_step_states,
    step_readers,
)
from pagedllm.model_executor.loader import load_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner

from helpers.model_helpers import make_tiny_llama

CAUSAL, ENCODER, CROSS = AttentionSpec.causal(), AttentionSpec.encoder(), AttentionSpec.cross()


def step() -> AttentionMetadata:
    return build_attention_metadata([1, 3], [5, 3], [[1, 2], [3]], 4)


def test_the_base_keeps_no_state() -> None:
    class Plain(AttentionBackend):
        def forward(self, *args):  # pragma: no cover - never called
            raise AssertionError

    meta = step()
    Plain().prepare_step(meta, [CAUSAL])
    assert meta.backend_state == {}


def test_torch_builds_only_what_its_layers_use() -> None:
    backend = TorchPagedAttentionBackend()
    meta = step()
    backend.prepare_step(meta, [CAUSAL])
    state = meta.backend_state[TorchStepState]
    assert isinstance(state, TorchStepState) and state.paged_plan is not None
    assert state.paged_plan.with_context == [0] and state.paged_plan.fresh_groups == {3: [1]}
    assert step_plan(meta) is state.paged_plan  # the layers read what was built
    assert state.encoder_plan is None and state.cross_layout is None

    long_sliding = step()  # every request within a window of 2 would slide: no paged plan
    backend.prepare_step(long_sliding, [AttentionSpec.sliding(2)])
    assert long_sliding.backend_state[TorchStepState].paged_plan is None
    short_sliding = step()  # a window longer than every request: the layer takes the causal path
    backend.prepare_step(short_sliding, [AttentionSpec.sliding(64)])
    assert short_sliding.backend_state[TorchStepState].paged_plan is not None

    encoder = build_attention_metadata([4, 9], [4, 9], [[], []], 16)
    backend.prepare_step(encoder, [ENCODER])
    state = encoder.backend_state[TorchStepState]
    assert state.paged_plan is None and encoder_plan(encoder) is state.encoder_plan is not None


def test_planning_keeps_nothing_only_prepare_step_does() -> None:
    meta, prepared = step(), step()
    TorchPagedAttentionBackend().prepare_step(prepared, [CAUSAL])
    plan = plan_step(meta)
    assert meta.backend_state == {} and prepared.step_state(TorchStepState) is prepared.backend_state[TorchStepState]
    expected = prepared.backend_state[TorchStepState].paged_plan
    assert (plan.fresh_groups, plan.with_context) == (expected.fresh_groups, expected.with_context)
    assert torch.equal(plan.with_context_tensor, expected.with_context_tensor)


def test_triton_hands_its_fallback_layers_their_state() -> None:
    backend = TritonPagedAttentionBackend(TorchPagedAttentionBackend())
    meta = step()
    backend.prepare_step(meta, [CAUSAL])
    assert meta.backend_state.get(TorchStepState, TorchStepState()) == TorchStepState()  # its kernel keeps none
    encoder = build_attention_metadata([4, 9], [4, 9], [[], []], 16)
    backend.prepare_step(encoder, [ENCODER, CAUSAL])
    state = encoder.backend_state[TorchStepState]
    assert state.encoder_plan is not None and state.paged_plan is None


def test_readers_are_the_layers_that_read_the_step() -> None:
    spy = TorchPagedAttentionBackend()
    model = torch.nn.ModuleList()
    for i, spec in enumerate([CAUSAL, CROSS, ENCODER, CAUSAL]):
        model.append(Attention(2, 8, 1.0, layer_idx=i, spec=spec, backend=spy))
    model[1].kv_group = 1
    # An encoder-decoder model's encoder layers read metadata of their own; the cached layers read the step's.
    assert sorted((g, sorted(s.kind for s in specs)) for g, _, specs in step_readers(model)) == [
        (0, ["causal"]), (1, ["cross"])]
    encoder_only = torch.nn.ModuleList([Attention(2, 8, 1.0, layer_idx=i, spec=ENCODER, backend=spy)
                                        for i in range(2)])
    assert [(g, set(specs)) for g, _, specs in step_readers(encoder_only)] == [(0, {ENCODER})]

    decoder, cross = step(), step()
    meta = link_groups([decoder, cross])
    prepare_step_states(meta, step_readers(model))
    assert decoder.backend_state[TorchStepState].paged_plan is not None
    assert cross.backend_state[TorchStepState].paged_plan is None  # the portable cross path needs nothing


class CountingBackend(TorchPagedAttentionBackend):
    def __init__(self) -> None:
        self.built = 0

    def build_state(self, meta, specs):
        self.built += 1
        return super().build_state(meta, specs)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model = load_model(ModelConfig(model=make_tiny_llama(tmp_path_factory.mktemp("state_llama")), dtype="float32"),
                       "cpu")
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, 4, 256, [2])
    runner.init_kv_cache(32)
    return runner


def test_the_runner_builds_each_steps_state_once_before_the_first_layer(runner: ModelRunner, monkeypatch) -> None:
    backend = CountingBackend()
    for layer in attention_layers(runner.model):
        layer.backend = backend
    runner._step_readers = None
    plans_built = []
    plan = torch_sdpa.plan_step

    def spy_plan(meta):
        plans_built.append(backend.built)  # how many states the hook had begun when the step was planned
        return plan(meta)

    monkeypatch.setattr(torch_sdpa, "plan_step", spy_plan)
    params = SamplingParams(temperature=0, max_tokens=4)
    sched = SchedulerOutput([NewRequestData("a", [5, 6, 7], [], params, ([1],), 0)], [], {"a": 3}, 3)
    first = runner.execute_model(sched)
    assert backend.built == 1
    second = runner.execute_model(SchedulerOutput([], [CachedRequestData("a", ([],), 3)], {"a": 1}, 1))
    assert backend.built == 2  # once per step, whatever the number of layers
    assert plans_built == [1, 2]  # each built by the hook (inside build_state), none by a layer
    assert first.sampled_token_ids["a"] and second.sampled_token_ids["a"]


def test_a_forward_over_unprepared_metadata_raises() -> None:
    backend = TorchPagedAttentionBackend()
    layer = Attention(2, 8, 1.0, layer_idx=0, spec=CAUSAL, backend=backend)
    layer.kv_cache = torch.zeros(2, 4, 4, 2, 8)
    x = torch.randn(4, 16)
    with forward_context(step()), pytest.raises(RuntimeError, match="not prepared"):
        layer(x, x, x)
    encoder = build_attention_metadata([4, 9], [4, 9], [[], []], 16)
    q = torch.randn(13, 2, 8)
    with pytest.raises(RuntimeError, match="not prepared"):
        backend.forward(q, q, q, None, encoder, ENCODER, 1.0)
    backend.prepare_step(encoder, [CAUSAL])  # prepared for other layers than the one that runs
    with pytest.raises(RuntimeError, match="has no encoder buckets"):
        backend.forward(q, q, q, None, encoder, ENCODER, 1.0)
    meta = step()
    prepare_step_states(meta, step_readers(torch.nn.ModuleList([layer])))
    with forward_context(meta):
        assert layer(x, x, x).shape == x.shape  # the same forward, prepared


def _count_specs(backend: CountingBackend) -> CountingBackend:
    backend.specs = []
    build = backend.build_state

    def recording(meta, specs):
        backend.specs.append(frozenset(specs))
        return build(meta, specs)

    backend.build_state = recording
    return backend


@pytest.mark.parametrize("method", ["draft_model", "layer_skip"])
def test_the_drafter_prepares_every_pass(method: str) -> None:
    from pagedllm.model_executor.models.llama import LlamaForCausalLM
    from pagedllm.spec_decode.model_drafter import make_draft_model_drafter, make_layer_skip_drafter
    from pagedllm.spec_decode.proposer import DraftJob

    from helpers.model_helpers import make_model_kv_caches, tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2), torch.float32)
    bind_kv_caches(model, make_model_kv_caches(model, 4, 16))
    backend = _count_specs(CountingBackend())
    for layer in attention_layers(model):
        layer.backend = backend
    device = torch.device("cpu")
    drafter = (make_draft_model_drafter(model, 16, device) if method == "draft_model"
               else make_layer_skip_drafter(model, 1, 16, device))
    # A catch-up pass over three tokens, then one one-token pass: two steps, each prepared before its layers run.
    proposals = drafter.propose_batch([DraftJob("a", [1, 2, 3], [1], 0, 3, 2, 0.0, None)])
    assert len(proposals.drafts["a"]) == 2
    assert backend.built == 2 and backend.specs == [frozenset({CAUSAL})] * 2


def test_the_whisper_encoder_prepares_its_step() -> None:
    from transformers import WhisperConfig

    from pagedllm.model_executor.models.whisper import WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
                           max_source_positions=8, max_target_positions=16)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    backend = _count_specs(CountingBackend())
    for layer in attention_layers(model):
        layer.backend = backend
    hidden = model.encode(torch.randn(3, 8, 16))  # three clips of 8 encoder positions
    assert hidden.shape == (24, 16) and torch.isfinite(hidden).all()
    assert backend.built == 1 and backend.specs == [frozenset({ENCODER})]  # its encoder layers, once
