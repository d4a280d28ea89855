"""Each attention backend builds its per-step state through one hook (``AttentionBackend.build_state``): the
model runner has it built once per eager step, before the first layer, under the backend's own key; metadata
built outside a runner still gets it lazily from the first layer that asks."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backends import torch_sdpa
from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.torch_encoder import encoder_plan
from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend, step_plan
from pagedllm.attention.backends.torch_state import TORCH_STATE_KEY, TorchStepState
from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, build_attention_metadata, link_groups
from pagedllm.attention.spec import AttentionSpec
from pagedllm.config import ModelConfig
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.model_executor.layers.attention import Attention, attention_layers, prepare_step_states, step_readers
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
    state = meta.backend_state[TORCH_STATE_KEY]
    assert isinstance(state, TorchStepState) and state.paged_plan is not None
    assert state.paged_plan.with_context == [0] and state.paged_plan.fresh_groups == {3: [1]}
    assert step_plan(meta) is state.paged_plan  # the layers read what was built
    assert state.encoder_plan is None and state.cross_layout is None

    long_sliding = step()  # every request within a window of 2 would slide: no paged plan
    backend.prepare_step(long_sliding, [AttentionSpec.sliding(2)])
    assert long_sliding.backend_state[TORCH_STATE_KEY].paged_plan is None
    short_sliding = step()  # a window longer than every request: the layer takes the causal path
    backend.prepare_step(short_sliding, [AttentionSpec.sliding(64)])
    assert short_sliding.backend_state[TORCH_STATE_KEY].paged_plan is not None

    encoder = build_attention_metadata([4, 9], [4, 9], [[], []], 16)
    backend.prepare_step(encoder, [ENCODER])
    state = encoder.backend_state[TORCH_STATE_KEY]
    assert state.paged_plan is None and encoder_plan(encoder) is state.encoder_plan is not None


def test_the_lazy_path_builds_the_same_plan_once() -> None:
    meta, prepared = step(), step()
    TorchPagedAttentionBackend().prepare_step(prepared, [CAUSAL])
    plan = step_plan(meta)
    assert step_plan(meta) is plan and meta.backend_state[TORCH_STATE_KEY].paged_plan is plan
    expected = prepared.backend_state[TORCH_STATE_KEY].paged_plan
    assert (plan.fresh_groups, plan.with_context) == (expected.fresh_groups, expected.with_context)
    assert torch.equal(plan.with_context_tensor, expected.with_context_tensor)


def test_triton_hands_its_fallback_layers_their_state() -> None:
    backend = TritonPagedAttentionBackend(TorchPagedAttentionBackend())
    meta = step()
    backend.prepare_step(meta, [CAUSAL])
    assert meta.backend_state.get(TORCH_STATE_KEY, TorchStepState()) == TorchStepState()  # its kernel keeps none
    encoder = build_attention_metadata([4, 9], [4, 9], [[], []], 16)
    backend.prepare_step(encoder, [ENCODER, CAUSAL])
    state = encoder.backend_state[TORCH_STATE_KEY]
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
    assert decoder.backend_state[TORCH_STATE_KEY].paged_plan is not None
    assert cross.backend_state[TORCH_STATE_KEY].paged_plan is None  # the portable cross path needs nothing


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
    plan = torch_sdpa.step_plan

    def spy_plan(meta):
        if meta.backend_state.get(TORCH_STATE_KEY) is None or meta.backend_state[TORCH_STATE_KEY].paged_plan is None:
            plans_built.append(backend.built)  # how many states the hook had built when a layer had to plan
        return plan(meta)

    monkeypatch.setattr(torch_sdpa, "step_plan", spy_plan)
    params = SamplingParams(temperature=0, max_tokens=4)
    sched = SchedulerOutput([NewRequestData("a", [5, 6, 7], [], params, ([1],), 0)], [], {"a": 3}, 3)
    first = runner.execute_model(sched)
    assert backend.built == 1
    second = runner.execute_model(SchedulerOutput([], [CachedRequestData("a", ([],), 3)], {"a": 1}, 1))
    assert backend.built == 2  # once per step, whatever the number of layers
    assert plans_built == [1, 2]  # each built by the hook (inside build_state), none by a layer
    assert first.sampled_token_ids["a"] and second.sampled_token_ids["a"]
