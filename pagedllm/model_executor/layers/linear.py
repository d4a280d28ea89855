"""``Linear``: a linear layer whose weights are owned by its quantization method.

The method (``layers/quantization``) creates the layer's parameters, gives each a ``weight_loader`` that
knows the layer's shards (fused q/k/v or gate/up), and repacks the weights in
``process_weights_after_loading`` into one ``BoundWeight`` (fp32 / bf16 panels, oneDNN's layout, int8 / 4-bit
panels, ...; ``quantization/bound_weight.py``), which the layer calls. After that step nothing may read
``.weight``: packing may replace it; ``Linear.packed`` is the weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.quantization.base import (
    CpuMatmul,
    LinearMethod,
    QuantizationConfig,
    load_rows,
    set_weight_loader,
)
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight
from pagedllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod


class Linear(DirectCall, nn.Module):
    """y = x @ W^T + b with W stored as its quantization method decides.

    ``shard_sizes``: output rows of each shard of a fused layer, in shard_id order (default: one shard).
    ``prefix``: the layer's parameter-name prefix (``model.layers.0.self_attn.qkv_proj``), for the method's
    choice and for error messages.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, shard_sizes: Sequence[int] | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.in_features = input_size
        self.out_features = output_size
        self.prefix = prefix
        self.shard_sizes = tuple(shard_sizes) if shard_sizes else (output_size,)
        if sum(self.shard_sizes) != output_size:
            raise ValueError(f"{prefix or 'Linear'}: shard sizes {self.shard_sizes} do not add up to {output_size}")
        dtype = dtype or torch.get_default_dtype()
        self.quant_method: LinearMethod = (quant_config.get_linear_method(self, prefix) if quant_config is not None
                                           else UnquantizedLinearMethod())
        self.quant_method.create_weights(self, dtype)
        # What forward calls: the method's apply until loading, then the bound weight's own call (bind_weight).
        self._matmul: CpuMatmul = self._apply_method
        if bias:
            b = nn.Parameter(torch.zeros(output_size, dtype=self.quant_method.bias_dtype(dtype)), requires_grad=False)
            self.bias = set_weight_loader(b, lambda p, w, shard_id=None: load_rows(self, p, w, shard_id))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]. ``out``: optional [M, N] float32 destination (M = rows of x), returned."""
        if x.dim() == 2:  # the model runner's flat [T, K] batches: no reshape round trip
            return self._matmul(x, self.bias, out)
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features), self.bias, out)
        return y if out is not None else y.view(*lead, self.out_features)

    def _apply_method(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias, out)

    def forward_activation(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """activation(x [M, K] @ W^T + b) fused into the matmul where the weight's method can ("gelu",
        "gelu_tanh", "relu"); None otherwise, and the caller applies the activation to ``forward``'s output."""
        return self.quant_method.apply_activation(self, x, self.bias, activation)

    def process_weights_after_loading(self) -> None:
        """Repack the loaded weights for the kernels (call once, after every shard is loaded)."""
        self.quant_method.process_weights_after_loading(self)
        self.bind_weight()

    @property
    def packed(self) -> BoundWeight | None:
        """The weight [out_features, in_features] as bound for its kernel, whatever the scheme (None before
        ``process_weights_after_loading``): what a LoRA term sits beside and MoE experts stack."""
        return self.quant_method.bound_weight(self)

    def bind_weight(self, weight: BoundWeight | None = None) -> None:
        """Make ``weight`` (the same weight bound another way: the autotuner's choice) this layer's weight, and
        ``forward`` call it; with None, rebind ``forward`` to the method's current weight."""
        if weight is not None:
            self.quant_method.set_bound_weight(self, weight)
        bound = self.packed
        self._matmul = bound.fast_matmul() if bound is not None else self._apply_method

    def weight_nbytes(self) -> int:
        """Bytes of this layer's weights as stored now (parameters, buffers, the method's packed copies)."""
        stored = sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])
        return stored + self.quant_method.packed_nbytes(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, quant={self.quant_method.name}")
