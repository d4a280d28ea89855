"""Fp8 checkpoints written from a float HF folder, as fp8 releases store them: float8_e4m3fn weights with
per-tensor, per-channel or block (16 x 16, transformers' fine-grained) scales."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedllm.model_executor.layers.quantization.qpanels import FP8_MAX

#: The projections an fp8 release quantizes (experts' ``experts.{e}.gate_proj`` ... included); routers, norms,
#: embeddings and the head stay float.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_checkpoint(src: Path, dst: Path, scheme: str, linear_names: tuple[str, ...] = LINEAR_NAMES
                   ) -> dict[str, torch.Tensor]:
    """Copy the float folder ``src`` to ``dst`` with its linear layers in fp8 (per ``scheme``: tensor, channel
    or block); returns the float weights the fp8 checkpoint stands for (w = scale * fp8), by name."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    dequantized = {}
    out = {}
    for name, t in tensors.items():
        if not (name.endswith(".weight") and any(f".{n}." in name for n in linear_names)):
            out[name] = t
            dequantized[name] = t.float()
            continue
        t = t.float()
        base = name.removesuffix(".weight")
        if scheme == "tensor":
            scale = t.abs().max() / FP8_MAX
            q = (t / scale).to(torch.float8_e4m3fn)
            out[f"{base}.weight_scale"] = scale.reshape(())
            out[f"{base}.input_scale"] = torch.tensor(0.1)  # static activation scale: read, not used
            expanded = scale
        elif scheme == "channel":
            scale = t.abs().amax(1, keepdim=True) / FP8_MAX
            q = (t / scale).to(torch.float8_e4m3fn)
            out[f"{base}.weight_scale"] = scale
            expanded = scale
        else:  # 16 x 16 blocks, transformers' fine-grained fp8 (scale_inv multiplies)
            n, k = t.shape
            blocks = t.view(n // 16, 16, k // 16, 16)
            scale = blocks.abs().amax((1, 3)) / FP8_MAX  # [n/16, k/16]
            expanded = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
            q = (t / expanded).to(torch.float8_e4m3fn)
            out[f"{base}.weight_scale_inv"] = scale
        out[name] = q
        dequantized[name] = q.float() * expanded
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "fp8", "activation_scheme": "static" if scheme == "tensor" else "dynamic"}
    if scheme == "block":
        qc["weight_block_size"] = [16, 16]
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized
