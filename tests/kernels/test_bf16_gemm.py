"""The bf16 panel matmul (``bf16_gemm``): its portable loop everywhere the kernels build, its AVX-512 BF16 path
against it where the CPU has AVX-512 BF16, and the autotuner's choice between it and oneDNN in a bf16 Linear
(outputs, fused activations, the copies each choice keeps)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import autotune
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.model_executor.layers.quantization.unquantized import pack_bf16_weight
from pagedllm.platforms import platform_for
from pagedllm.platforms.cpu_probes import onednn_bf16_available

from helpers.autotune import LayersModel, use_own_autotune_cache

KERNELS = platform_for(torch.device("cpu")).cpu_kernels(torch.float32)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
HAS_BF16_DOT = KERNELS is not None and KERNELS.bf16_gemm_supported()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 96), (16, 2), (130, 256)])
@pytest.mark.parametrize("bias", [True, False])
def test_generic_path_matches_float_reference(m: int, n: int, k: int, bias: bool) -> None:
    torch.manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = pack_bf16_weight(w)
    assert packed.shape == (-(-n // 16), k // 2, 16, 2)
    _close(KERNELS.bf16_gemm(x, packed, n, b, None, True), _reference(x, w, b))


@needs_kernels
@pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX-512 BF16: only the portable bf16_gemm runs here")
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 31, 200])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 96), (130, 256), (576, 1536)])
def test_avx512_bf16_path_matches_the_portable_loop(m: int, n: int, k: int) -> None:
    torch.manual_seed(m + n * 7 + k)
    w, x, b = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16(), torch.randn(n).bfloat16()
    packed = pack_bf16_weight(w)
    fast = KERNELS.bf16_gemm(x, packed, n, b)
    _close(fast, KERNELS.bf16_gemm(x, packed, n, b, None, True).float())
    _close(fast, _reference(x, w, b))
    wide = torch.zeros(m, n + 5, dtype=torch.bfloat16)  # out= with strided rows
    KERNELS.bf16_gemm(x, packed, n, b, wide[:, :n])
    assert torch.equal(wide[:, :n], fast) and not wide[:, n:].any()


@needs_kernels
@pytest.mark.parametrize("generic", [True, False], ids=["portable", "avx512_bf16"])
@pytest.mark.parametrize("m", [1, 9, 64])
def test_a_float32_out_gets_the_unrounded_sums(generic: bool, m: int) -> None:
    if not generic and not HAS_BF16_DOT:
        pytest.skip("this CPU has no AVX-512 BF16")
    torch.manual_seed(m)
    n, k = 37, 96
    w, x, b = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16(), torch.randn(n).bfloat16()
    wide = torch.full((m, n + 3), 7.0)  # strided float32 rows: the columns past N stay untouched
    got = KERNELS.bf16_gemm(x, pack_bf16_weight(w), n, b, wide[:, :n], generic)
    assert got.dtype == torch.float32 and (wide[:, n:] == 7.0).all()
    torch.testing.assert_close(got, _reference(x, w, b), rtol=1e-5, atol=1e-4)  # float32 sums, not bf16


@needs_kernels
def test_bad_shapes_are_refused() -> None:
    w = torch.randn(32, 64).bfloat16()
    packed = pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS.bf16_gemm(torch.randn(2, 64), packed, 32, None, None, True)
    with pytest.raises(RuntimeError, match="columns"):
        KERNELS.bf16_gemm(torch.randn(2, 62).bfloat16(), packed, 32, None, None, True)
    with pytest.raises(RuntimeError, match="out_features"):
        KERNELS.bf16_gemm(torch.randn(2, 64).bfloat16(), packed, 64, None, None, True)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    use_own_autotune_cache(tmp_path, monkeypatch)


@pytest.mark.skipif(not (HAS_BF16_DOT and onednn_bf16_available()),
                    reason="this CPU has no AVX-512 BF16: bf16 layers run oneDNN only")
@pytest.mark.parametrize("panels_to", [2, 5], ids=["mixed", "panels-everywhere"])
def test_bf16_linear_autotuned_between_onednn_and_panels(own_cache, panels_to: int) -> None:
    torch.manual_seed(panels_to)
    layer = Linear(96, 40, bias=True, dtype=torch.bfloat16)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert layer.packed.onednn is not None and layer.packed.source is not None
    xs = [torch.randn(rows, 96).bfloat16() for rows in (1, 5, 20, 100, 300)]

    def timer(kernel, x):  # the panels win the first `panels_to` buckets
        return 0.5 if (kernel.__name__ == "panels") == (autotune.bucket_index(x.shape[0]) < panels_to) else 1.0

    model = LayersModel([layer])
    kernel_choice.autotune_model(model, "on", timer)
    kernel_choice.release_tuning_state(model)
    assert layer.packed.source is None
    (entry,) = json.loads(autotune.default_path().read_text())["entries"].values()
    assert entry["choices"] == ["panels"] * panels_to + ["onednn"] * (5 - panels_to)
    assert layer.packed.panels is not None
    assert (layer.packed.onednn is None) == (panels_to == 5)  # oneDNN's copy goes when no bucket runs it
    for x in xs:
        ref = _reference(x, w, b)
        _close(layer(x), ref)
        _close(layer(x.unsqueeze(0)).squeeze(0), ref)
        for act, fn in [("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")), ("relu", F.relu)]:
            _close(layer.forward_activation(x, act), fn(ref))
        out = torch.full((x.shape[0], 40), float("nan"))  # a float32 destination, as the LM head's logits buffer
        assert layer(x, out=out) is out
        _close(out.bfloat16(), ref)


@pytest.mark.skipif(not (HAS_BF16_DOT and onednn_bf16_available()),
                    reason="this CPU has no AVX-512 BF16: bf16 layers run oneDNN only")
def test_bf16_linear_stays_on_onednn_when_not_tuned() -> None:
    layer = Linear(96, 40, bias=False, dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    model = LayersModel([layer])
    kernel_choice.autotune_model(model, "off")
    kernel_choice.release_tuning_state(model)
    assert layer.packed.source is None and layer.packed.panels is None and set(layer.packed.choices) == {"onednn"}
    assert layer.packed.onednn is not None
