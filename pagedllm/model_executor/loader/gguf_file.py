"""A small, fast GGUF reader: metadata, tensor directory, and tensors dequantized on demand.

``gguf.GGUFReader`` builds a numpy view per array element (seconds for a 49k-token vocabulary); this
reader parses the header with ``struct`` and memory-maps the data, so opening a file takes milliseconds.
Dequantization uses ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    """``shape`` is in GGUF order ([in, out] for a matrix): the reverse of torch's (out, in)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file


_FLOAT_TYPES = (0, 1, 30)  # GGML F32, F16, BF16

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def block_part(gguf_name: str) -> tuple[str, str] | None:
    """``blk.3.attn_qkv.weight`` -> ``("3", "attn_qkv")``; None for tensors outside the layer blocks."""
    m = _BLOCK_RE.match(gguf_name)
    return (m.group(1), m.group(2)) if m else None


def gguf_hf_name(gguf_name: str, layer_names: dict[str, str], global_names: dict[str, str], arch: str,
                 layer_prefix: str = "model.layers") -> str:
    """A GGUF tensor name in HF's naming: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``
    through ``layer_names`` (per-layer parts) and ``global_names`` (the rest); ValueError naming ``arch`` if
    the tensor has no counterpart."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in layer_names:
            return f"{layer_prefix}.{layer}.{layer_names[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in global_names:
            return f"{global_names[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no {arch} counterpart")


def iter_expert_tensors(gguf: GGUFFile, name: str, hf_name: str, keep_quantized: bool) -> Any:
    """A MoE expert stack ``name`` ([E, rows, K], e.g. ``blk.0.ffn_gate_exps.weight``, HF name
    ``...mlp.experts.gate_proj.weight``) as one ``(...mlp.experts.{e}.gate_proj.weight, tensor)`` per expert, the
    way an HF checkpoint stores them: raw blocks where ``keep_quantized`` and the stack is quantized, else float."""
    head, _, tail = hf_name.rpartition(".experts.")
    raws = gguf.load_raw_experts(name) if keep_quantized else None
    experts = raws if raws is not None else torch.from_numpy(np.array(gguf.load(name), dtype=np.float32))
    for e in range(len(experts)):
        yield f"{head}.experts.{e}.{tail}", experts[e]


class GGUFFile:
    """Parsed header of a GGUF v2/v3 file plus a read-only memory map of its data."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(self._data)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"model: {path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"model: {path}: GGUF version {version} is too old (need 2 or 3)")
        self.version = version
        self._buf = buf
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.metadata[key], pos = self._value(vtype, pos)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(pos // -align) * align
        self.tensors = {name: GGUFTensorInfo(name, dims, t, data_start + off) for name, dims, t, off in infos}

    def has_quantized_matrices(self) -> bool:
        """Whether any 2-D tensor is stored in a quantized block type (not F32 / F16 / BF16)."""
        return any(len(t.shape) == 2 and t.ggml_type not in _FLOAT_TYPES for t in self.tensors.values())

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        pos += 8
        return bytes(self._buf[pos:pos + n]).decode("utf-8", errors="replace"), pos + n

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            elem_type, count = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            if elem_type in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[elem_type])
                arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=pos)
                return arr.tolist(), pos + count * dt.itemsize
            items = []
            for _ in range(count):
                item, pos = self._value(elem_type, pos)
                items.append(item)
            return items, pos
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"GGUF {self.path}: unknown metadata value type {vtype}")
        return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)

    def tensor_nbytes(self, info: GGUFTensorInfo) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        return int(np.prod(info.shape)) // block_size * type_size

    def load(self, name: str) -> np.ndarray:
        """Dequantized float array in torch order (reversed GGUF shape), e.g. (out, in) for a matrix."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        nbytes = self.tensor_nbytes(info)
        raw = self._data[info.offset:info.offset + nbytes]
        row_bytes = nbytes // int(np.prod(info.shape[1:], dtype=np.int64))
        if qtype == GGMLQuantizationType.F32:
            out = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            out = raw.view(np.float16)
        else:
            out = dequantize(raw.reshape(-1, row_bytes), qtype)
        return out.reshape(tuple(reversed(info.shape)))

    def load_raw_experts(self, name: str) -> list[Any] | None:
        """A quantized MoE expert stack [E, rows, K] (``ffn_gate_exps``...) as one ``GGUFQuantTensor`` per expert, or
        None for a float tensor."""
        from gguf import GGMLQuantizationType

        from pagedllm.model_executor.layers.quantization.gguf import GGUFQuantTensor

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        if len(info.shape) != 3 or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                              GGMLQuantizationType.BF16):
            return None
        k, rows, experts = info.shape
        nbytes = self.tensor_nbytes(info)
        raw = torch.from_numpy(np.array(self._data[info.offset:info.offset + nbytes]).reshape(experts, rows, -1))
        return [GGUFQuantTensor(raw[e], int(info.ggml_type), (rows, k)) for e in range(experts)]

    def load_raw(self, name: str) -> Any:
        """A quantized matrix's blocks as stored (a ``GGUFQuantTensor``, rows in torch order), or None for a
        float (F32/F16/BF16) or non-matrix tensor."""
        from gguf import GGMLQuantizationType

        from pagedllm.model_executor.layers.quantization.gguf import GGUFQuantTensor

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        if len(info.shape) != 2 or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                              GGMLQuantizationType.BF16):
            return None
        k, rows = info.shape
        nbytes = self.tensor_nbytes(info)
        raw = np.array(self._data[info.offset:info.offset + nbytes]).reshape(rows, nbytes // rows)
        return GGUFQuantTensor(torch.from_numpy(raw), int(info.ggml_type), (rows, k))

