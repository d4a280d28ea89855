"""The float ``BoundWeight`` forms (plain, float32 panels, bf16 oneDNN / panels): each equals F.linear within its
dtype's rounding and the kernel call it binds bit for bit; the autotuner's choice builds a new weight the layer
binds (no layer attribute written from outside); ``nbytes`` counts the copies each form keeps."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import autotune
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.model_executor.layers.quantization.bf16_weights import Bf16Weight
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight
from pagedllm.model_executor.layers.quantization.float_weights import (
    Float32Panels,
    PlainWeight,
    pack_bf16_weight,
    pack_weight,
)
from pagedllm.model_executor.layers.quantization.unquantized import bind_float_weight
from pagedllm.model_executor.layers.quantization.weight_only import Int8Config
from pagedllm.platforms import platform_for
from pagedllm.platforms.cpu_probes import onednn_bf16_available

from helpers.autotune import LayersModel, use_own_autotune_cache

KERNELS = platform_for(torch.device("cpu")).cpu_kernels(torch.float32)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
HAS_BF16_PANELS = KERNELS is not None and KERNELS.bf16_gemm_supported() and onednn_bf16_available()
needs_onednn = pytest.mark.skipif(not onednn_bf16_available(), reason="this CPU has no native bf16 for oneDNN")
needs_bf16_panels = pytest.mark.skipif(not HAS_BF16_PANELS, reason="this CPU has no AVX-512 BF16 panels")
ROWS = (1, 5, 20, 100, 300)  # one batch in each bucket of rows (autotune.BUCKET_ROWS)
N, K = 40, 96


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    use_own_autotune_cache(tmp_path, monkeypatch)


def _loaded(dtype: torch.dtype, seed: int = 0) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A processed Linear [N, K] with a bias, and copies of its weight and bias as loaded."""
    torch.manual_seed(seed)
    layer = Linear(K, N, bias=True, dtype=dtype)
    layer.bias.data.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.process_weights_after_loading()
    return layer, w, b


def test_plain_weight_is_the_layers_parameter_and_f_linear() -> None:
    layer, w, b = _loaded(torch.float16)
    assert isinstance(layer.packed, PlainWeight) and layer.packed.weight is layer.weight
    x = torch.randn(3, K, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, w, b))
    assert layer.packed.nbytes() == N * K * 2
    assert layer.weight_nbytes() == N * K * 2 + N * 2  # counted once, as the parameter
    assert layer.packed.cpu_matmul() is None and layer.forward_activation(x, "gelu") is None
    assert layer.quant_method.scheme(layer) == "unquantized float16"


@needs_kernels
def test_float32_panels_bind_packed_gemm() -> None:
    layer, w, b = _loaded(torch.float32)
    weight = layer.packed
    assert isinstance(weight, Float32Panels) and layer.weight is None
    packed = pack_weight(w)
    assert weight.nbytes() == packed.numel() * 4 == -(-N // 16) * 16 * K * 4
    assert layer.weight_nbytes() == weight.nbytes() + N * 4
    assert weight.cpu_matmul() is weight.fast_matmul()  # the flat fp32 call is the kernel itself
    for m in ROWS:
        x = torch.randn(m, K)
        want = KERNELS.packed_gemm(x, packed, N, b, None)  # the call the layer made before it had a weight object
        assert torch.equal(layer(x), want)
        assert torch.equal(layer(x.view(1, m, K)), want.view(1, m, N))
        torch.testing.assert_close(want, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        out = torch.full((m, N), float("nan"))
        assert layer(x, out=out) is out and torch.equal(out, want)
    assert layer.forward_activation(torch.randn(2, K), "gelu") is None  # no fused form: the caller applies it
    assert layer.quant_method.scheme(layer) == "unquantized float32"


@needs_kernels
def test_float32_choices_build_new_weights_per_bucket() -> None:
    layer, w, b = _loaded(torch.float32, seed=1)
    weight = layer.packed
    assert weight.with_choices(["panels"] * 5) is weight  # the packing's own kernel: nothing to rebuild
    packed = pack_weight(w)
    mixed = weight.with_choices(["panels", "panels", "blas", "blas", "blas"])
    assert mixed is not weight and weight.choices == ("panels",) * 5  # the old weight is left as it was
    assert mixed.nbytes() == packed.numel() * 4 + N * K * 4 and mixed.extra_copy_nbytes() == N * K * 4
    blas = weight.with_choices(["blas"] * 5)
    assert blas.panels is None and blas.nbytes() == N * K * 4 and blas.extra_copy_nbytes() == 0
    for m in ROWS:
        x = torch.randn(m, K)
        panels_y = KERNELS.packed_gemm(x, packed, N, b, None)
        blas_y = torch.addmm(b, x, w.T)
        assert torch.equal(mixed.matmul(x, b), panels_y if m <= 8 else blas_y)
        assert torch.equal(blas.matmul(x, b), blas_y)


@needs_kernels
def test_the_autotuners_choice_rebinds_the_layer() -> None:
    layer, w, b = _loaded(torch.float32, seed=2)
    before = layer.packed
    names = set(vars(layer))

    def timer(kernel, x):  # BLAS wins from 33 rows on
        return 0.5 if (kernel.__name__ == "blas") == (autotune.bucket_index(x.shape[0]) >= 3) else 1.0

    kernel_choice.autotune_model(LayersModel([layer]), "on", timer)
    (entry,) = json.loads(autotune.default_path().read_text())["entries"].values()
    assert entry["choices"] == ["panels"] * 3 + ["blas"] * 2
    assert set(vars(layer)) == names  # the layer holds what it held: a new weight object, bound by the layer
    assert layer.packed is not before and layer.packed.choices == tuple(entry["choices"])
    for m in ROWS:
        x = torch.randn(m, K)
        want = KERNELS.packed_gemm(x, pack_weight(w), N, b, None) if m <= 32 else torch.addmm(b, x, w.T)
        assert torch.equal(layer(x), want)


@needs_onednn
def test_bf16_onednn_weight_binds_the_fused_op() -> None:
    layer, w, b = _loaded(torch.bfloat16, seed=3)
    weight = layer.packed
    assert isinstance(weight, Bf16Weight) and weight.panels is None and layer.weight is None
    assert weight.nbytes() == N * K * 2 and layer.quant_method.scheme(layer) == "unquantized bfloat16 (oneDNN packed)"
    assert weight.cpu_matmul() is None  # no float32 C++ kernel: step graphs refuse oneDNN batches
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    for m in (1, 7, 300):
        x = torch.randn(m, K).bfloat16()
        want = torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], "")
        assert torch.equal(layer(x), want)
        torch.testing.assert_close(want.float(), F.linear(x.float(), w.float(), b.float()), atol=0.05, rtol=0.02)
        gelu = torch.ops.mkldnn._linear_pointwise(x, onednn, b, "gelu", [], "tanh")
        assert torch.equal(layer.forward_activation(x, "gelu_tanh"), gelu)
        assert layer.forward_activation(x, "silu") is None


@needs_bf16_panels
def test_bf16_panels_per_bucket_beside_onednn() -> None:
    layer, w, b = _loaded(torch.bfloat16, seed=4)
    weight = layer.packed
    assert weight.source is not None  # kept for the autotuner
    mixed = weight.with_choices(["panels", "panels", "onednn", "onednn", "onednn"])
    panels = pack_bf16_weight(w)
    assert torch.equal(mixed.panels, panels) and mixed.onednn is weight.onednn
    assert mixed.describe() == "bfloat16 (panels + oneDNN)"
    assert mixed.nbytes() == weight.nbytes() + panels.numel() * 2 and mixed.extra_copy_nbytes() == panels.numel() * 2
    released = mixed.without_tuning_state()
    assert released.source is None and released.choices == mixed.choices and released.nbytes() == mixed.nbytes()
    layer.bind_weight(released)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    for m in ROWS:
        x = torch.randn(m, K).bfloat16()
        on_panels = m <= 8
        want = (KERNELS.bf16_gemm(x, panels, N, b) if on_panels
                else torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], ""))
        assert torch.equal(layer(x), want)
        if on_panels:
            relu = KERNELS.bf16_gemm(x, panels, N, b).relu_()
        else:
            relu = torch.ops.mkldnn._linear_pointwise(x, onednn, b, "relu", [], "")
        assert torch.equal(layer.forward_activation(x, "relu"), relu)
        out = torch.full((m, N), float("nan"))  # a float32 destination (the LM head's logits)
        assert layer(x, out=out) is out and torch.equal(out, want.float())
    everywhere = weight.with_choices(["panels"] * 5)
    assert everywhere.onednn is None and everywhere.describe() == "bfloat16 (panels)"
    assert everywhere.nbytes() == panels.numel() * 2 and everywhere.extra_copy_nbytes() == 0


@needs_kernels
def test_bind_float_weight_picks_the_form_by_dtype() -> None:
    assert isinstance(bind_float_weight(torch.randn(N, K)), Float32Panels)
    assert isinstance(bind_float_weight(torch.randn(N, K, dtype=torch.float16)), PlainWeight)
    assert isinstance(bind_float_weight(torch.randn(N, K, device="meta")), PlainWeight)
    if onednn_bf16_available():
        assert isinstance(bind_float_weight(torch.randn(N, K).bfloat16()), Bf16Weight)


class _WithDelta(BoundWeight):
    """A weight plus a low-rank term beside its matmul (the shape of a LoRA layer): y = base(x) + x A^T B^T."""

    def __init__(self, base: BoundWeight, a: torch.Tensor, b: torch.Tensor) -> None:
        self.base, self.a, self.b = base, a, b
        self.out_features, self.in_features = base.out_features, base.in_features

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.base.matmul(x, bias, None) + (x @ self.a.T) @ self.b.T

    def nbytes(self) -> int:
        return self.base.nbytes() + (self.a.numel() + self.b.numel()) * 4


@needs_kernels
def test_any_bound_weight_can_stand_in_a_layer() -> None:
    layer, w, b = _loaded(torch.float32, seed=5)
    base = layer.packed
    a, up = torch.randn(4, K), torch.randn(N, 4)
    layer.bind_weight(_WithDelta(base, a, up))
    x = torch.randn(3, K)
    assert torch.equal(layer(x), base.matmul(x, b) + (x @ a.T) @ up.T)
    assert layer.weight_nbytes() == base.nbytes() + (4 * K + N * 4) * 4 + N * 4


@needs_kernels
def test_a_quantized_layers_call_is_its_kernel_or_the_dequantized_product() -> None:
    torch.manual_seed(6)
    layer = Linear(K, N, bias=True, quant_config=Int8Config())
    layer.weight.weight_loader(layer.weight, torch.randn(N, K))
    layer.bias.data.normal_()
    layer.process_weights_after_loading()
    x = torch.randn(3, K)
    assert torch.equal(layer(x), layer.qpanels.cpu_matmul()(x, layer.bias, None))  # float32: the bound kernel
    x64 = x.double()  # activations the kernel does not take: the dequantized weight, as PackedWeight.matmul
    assert torch.equal(layer(x64), F.linear(x64, layer.qpanels.dequantize().double(), layer.bias.double()))
