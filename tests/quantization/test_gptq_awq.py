"""GPTQ / AWQ loaders against checkpoints packed here by a packer written from the published formats
(AutoGPTQ: inputs packed in qweight, outputs in qzeros stored minus one; AutoAWQ GEMM: outputs packed in the
order 0 2 4 6 1 3 5 7)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization.gptq_awq import AWQ_ORDER, AWQConfig, GPTQConfig
from pagedllm.model_executor.loader.model_config import resolve_model_config
from pagedllm.model_executor.loader.model_loader import load_model

from helpers.model_helpers import make_tiny_llama, prefill_logits


def _quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [N, K], z [G, N], s [G, N] (float16), reference w' = s * (q - z) [N, K]."""
    n, k = w.shape
    groups = k // group
    maxq = 2 ** bits - 1
    z = torch.empty(groups, n, dtype=torch.int64)
    s = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s[g] = (torch.maximum(-lo, hi) * 2 / maxq).half()
            z[g] = (maxq + 1) // 2
        else:
            s[g] = ((hi - lo) / maxq).half()
            z[g] = torch.round(-lo / s[g].float()).clamp(1, maxq).long()  # GPTQ v1 cannot store z = 0
    sk, zk = s.float()[g_idx].t(), z[g_idx].t()  # per input: [N, K]
    q = torch.clamp(torch.round(w / sk) + zk, 0, maxq).long()
    return q, z, s, sk * (q - zk)


def _pack_words(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., pf] unsigned values -> int32 [...] with value j at bit bits * j."""
    pf = 32 // bits
    words = np.zeros(vals.shape[:-1], dtype=np.uint32)
    for j in range(pf):
        words |= vals[..., j].numpy().astype(np.uint32) << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32))


def pack_gptq(w: torch.Tensor, bits: int, group: int, sym: bool = True, act_order: bool = False
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    pf = 32 // bits
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    q, z, s, ref = _quantize(w, bits, group, sym, g_idx)
    qweight = _pack_words(q.t().reshape(k // pf, pf, n).transpose(1, 2), bits)  # [K/pf, N]
    qzeros = _pack_words((z - 1).reshape(-1, n // pf, pf), bits)  # [G, N/pf], stored minus one
    return {"qweight": qweight, "qzeros": qzeros, "scales": s, "g_idx": g_idx.to(torch.int32)}, ref


def pack_awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    q, z, s, ref = _quantize(w, 4, group, False, torch.arange(k) // group)
    order = list(AWQ_ORDER)
    qweight = _pack_words(q.t().reshape(k, n // 8, 8)[..., order], 4)  # [K, N/8]
    qzeros = _pack_words(z.reshape(-1, n // 8, 8)[..., order], 4)  # [G, N/8]
    return {"qweight": qweight, "qzeros": qzeros, "scales": s}, ref


CASES = {
    "gptq4-sym": (GPTQConfig(4, 32), lambda w: pack_gptq(w, 4, 32)),
    "gptq4-asym-g64": (GPTQConfig(4, 64, sym=False), lambda w: pack_gptq(w, 4, 64, sym=False)),
    "gptq8-sym": (GPTQConfig(8, 32), lambda w: pack_gptq(w, 8, 32)),
    "gptq4-act-order": (GPTQConfig(4, 32, desc_act=True), lambda w: pack_gptq(w, 4, 32, act_order=True)),
    "awq4": (AWQConfig(4, 32), lambda w: pack_awq(w, 32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_layer_matches_the_checkpoint_dequantized(case: str) -> None:
    config, pack = CASES[case]
    torch.manual_seed(0)
    shards = [torch.randn(n, 128) * 0.1 for n in (64, 32)]
    layer = Linear(128, 96, bias=False, dtype=torch.float32, quant_config=config, shard_sizes=(64, 32),
                   prefix="mlp.gate_up_proj")
    refs = []
    for i, w in enumerate(shards):
        tensors, ref = pack(w)
        refs.append(ref)
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t, i)
    layer.process_weights_after_loading()
    ref = torch.cat(refs)
    if case == "gptq4-act-order":  # re-quantized to int8 per channel: within half an int8 step
        assert (layer.qpanels.dequantize() - ref).abs().max() <= ref.abs().amax() / 254 * 1.01
        assert "int8" in layer.quant_method.scheme(layer)
    else:  # the packed integers map onto the kernel's panels exactly; min = -scale * zero is rounded to float16
        torch.testing.assert_close(layer.qpanels.dequantize(), ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-6)
    x = torch.randn(5, 128)
    # 4-bit layers quantize x to two int8 terms per group (~16-bit precise): docs/quantization.md
    tol = 1e-3 if layer.qpanels.is_q4 else 1e-4
    torch.testing.assert_close(layer(x), F.linear(x, layer.qpanels.dequantize()), atol=tol, rtol=tol)


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_checkpoint_folder_loads_and_matches_its_dequantized_float_model(tmp_path: Path, fmt: str) -> None:
    """A tiny Llama saved as a GPTQ/AWQ checkpoint gives the logits of the same weights dequantized."""
    src = Path(make_tiny_llama(tmp_path / "float"))
    state = load_file(src / "model.safetensors")
    quant_state, float_state = {}, {}
    torch.manual_seed(1)
    for name, t in state.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in _LINEARS):
            tensors, ref = pack_gptq(t.float(), 4, 32) if fmt == "gptq" else pack_awq(t.float(), 32)
            base = name.removesuffix(".weight")
            quant_state.update({f"{base}.{k}": v.contiguous() for k, v in tensors.items()})
            float_state[name] = ref.contiguous()
        else:
            quant_state[name] = t
            float_state[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for folder, tensors, extra in (
        ("quant", quant_state, {"quantization_config": {"quant_method": fmt, "bits": 4, "group_size": 32,
                                                        "desc_act": False, "sym": True, "version": "gemm"}}),
        ("deq", float_state, {}),
    ):
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
        (tmp_path / folder / "config.json").write_text(json.dumps({**cfg, **extra}))
    quant = load_model(resolve_model_config(ModelConfig(model=str(tmp_path / "quant"))))
    assert quant.quant_config.name == fmt and quant.dtype == torch.float32
    deq = load_model(resolve_model_config(ModelConfig(model=str(tmp_path / "deq"), dtype="float32")))
    ids = list(range(3, 40))
    torch.testing.assert_close(prefill_logits(quant, ids), prefill_logits(deq, ids), atol=5e-3, rtol=1e-3)


def test_unknown_checkpoint_format_fails_at_start_up(tmp_path: Path) -> None:
    src = Path(make_tiny_llama(tmp_path / "m"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bitsandbytes.*supported checkpoint formats: gptq, awq"):
        resolve_model_config(ModelConfig(model=str(src)))
    with pytest.raises(ValueError, match="already quantized"):
        resolve_model_config(ModelConfig(model=str(src), quantization="int8"))


@pytest.mark.parametrize("case", ["gptq4-sym", "gptq8-sym", "gptq4-act-order", "awq4"])
def test_packed_weight_lives_on_the_layers_device(case: str) -> None:
    """Checkpoint tensors arrive on the CPU; a CUDA layer must pack them on CUDA (else its matmul would mix
    devices). Checked with a layer on the meta device, which stands in for a non-CPU one."""
    config, pack = CASES[case]
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = Linear(128, 64, bias=False, dtype=torch.float32, quant_config=config, prefix="mlp.down_proj")
    tensors, _ = pack(torch.randn(64, 128) * 0.1)
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t)
    layer.process_weights_after_loading()
    assert layer.qpanels.qweight.device.type == "meta" and layer.qpanels.scales.device.type == "meta"
