"""``FusedMoE``: every expert MLP of one layer as one module, weights stacked per layer.

    x [T, H] --router logits--> top-k (routing.py) --> rows sorted by expert (grouping.py)
      --> per expert run: down(act(gate(x)) * up(x)) on that expert's rows only --> weighted, summed per token

Weights: ``gate_up_proj`` [E, 2 * I, H] (rows [gate | up] of each expert) and ``down_proj`` [E, H, I], the layout
transformers keeps in memory, filled from a checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight``:
``WeightMapping.experts``) or from the fused 3D tensors some checkpoints store. Under tensor parallelism each rank
holds a slice of every expert's intermediate dimension (I / ranks) and the partial outputs are summed by one
all-reduce, as a row-parallel down projection would; with expert parallelism (``--enable-expert-parallel``) each
rank holds E / ranks whole experts instead, runs the (token, expert) pairs routed to them (every rank has every
token: attention is tensor-parallel) and the same all-reduce sums each token's experts across ranks.

How the experts multiply (``process_weights_after_loading`` picks one, once; ``describe`` names it):
- float32 on a CPU with the C++ kernels: each expert's projections packed into packed_gemm's panels, stacked
  [E, P, K, 16]; one C++ call per projection (``moe_packed_gemm``, ``kernels/csrc/moe_gemm.cpp``) threads over
  (expert, range of panels) for the experts that have rows, so a decode token reads its k experts only;
- a ``--quantization`` scheme, bf16 on the CPU, or a GGUF file's blocks kept quantized: each expert's two
  projections are ``Linear`` layers of that scheme (packed weights, the same ``BoundWeight`` forms and kernels dense
  layers use: int8 / int4 / fp8 panels, oneDNN's bf16 layout or bf16 panels, GGUF Q8_0 / Q4 panels), called for the
  experts that have rows. Float32 activations on a CPU with the C++ kernels: where every expert's projection
  packed into the same panel format, the panels are stacked and the experts run in one ``moe_quant_gemm`` call
  per projection, routed in C++ as the float32 panels are (``stacked.py``). bf16 on a CPU with AVX-512 BF16:
  ``bf16_gemm``'s panels of every expert stacked [E, P, K/2, 16, 2], one ``moe_bf16_gemm`` call per projection,
  routed in C++ too (bf16 rows gathered and summed back, the sums in float32);
- CUDA (where Triton runs): float stacks, or a ``--quantization`` scheme's experts in the weight-only row layout
  stacked [E, ...] (``stacked.stack_rows``), run by Triton's grouped matmul (``kernels/triton_moe.py``): one launch
  per projection over the sorted rows, tiles of one expert each, the first reading x through the sort (no gathered
  copy), the biases added per row; the outputs summed back per token in slot order by a combine kernel, with no
  host synchronisation, so a CUDA graph records the layer;
- other float weights (a CPU without the C++ kernels; CUDA without Triton): the grouped matmul over the sorted rows
  (``torch.nn.functional.grouped_mm``: one call per projection, experts with no rows skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import all_reduce, divide, get_tp
from pagedllm.kernels.triton_moe import StackedRows, block_m_for, expert_tiles, moe_combine, moe_grouped_matmul
from pagedllm.model_executor.layers.activation import gated_activation
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.fused_moe.grouping import ExpertGroups, group_by_expert
from pagedllm.model_executor.layers.fused_moe.routing import RoutingRule, select_experts
from pagedllm.model_executor.layers.fused_moe.stacked import StackedProjection, stack_projection, stack_rows
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.parallel_linear import Slice, even_part
from pagedllm.model_executor.layers.quantization.base import set_weight_loader, to_empty_keeping_loaders
from pagedllm.model_executor.layers.quantization.float_weights import pack_bf16_weight, pack_weight
from pagedllm.platforms import platform_of

GATE, UP = 0, 1  # row shards of gate_up_proj, the ``which`` of a per-expert tensor's (expert, which) shard id
DOWN = 2  # a kept GGUF expert's down projection (its key among the blocks)


def triton_experts_for(weight: torch.Tensor) -> bool:
    """Whether experts whose weights live where ``weight`` does run Triton's grouped matmul: where the platform's
    linear kernels are Triton's (quantized weights packed by rows: CUDA) and Triton runs."""
    platform = platform_of(weight)
    return platform.packs_quantized_by_rows and platform.runs_triton()


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [R, K] sorted by expert, weights [E, N, K], ends [E] int32 -> rows[run e] @ weights[e]^T, [R, N].

    torch's grouped matmul needs rows of whole 16-byte multiples, and on CUDA bf16; other cases (tiny test shapes,
    float32 / float16 on a GPU) take the loop over the experts that have rows."""
    row_bytes = rows.element_size()
    aligned = (weights.shape[1] * row_bytes) % 16 == 0 and (weights.shape[2] * row_bytes) % 16 == 0
    if aligned and (not platform_of(rows).is_accelerator or rows.dtype == torch.bfloat16):
        return F.grouped_mm(rows.contiguous(), weights.transpose(1, 2), offs=ends)
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            torch.mm(rows[start:end], weights[expert].T, out=out[start:end])
        start = end
    return out


class FusedMoE(DirectCall, nn.Module):
    """The routed experts of one MoE layer (``rule.num_experts`` gated MLPs of ``intermediate_size`` each).

    ``forward(x [T, H], router_logits [T, E]) -> [T, H]``: the router weights applied and the k experts' outputs
    summed per token (all-reduced across tensor-parallel ranks).

    ``act``: an HF ``hidden_act`` name or a gated activation [R, 2I] -> [R, I] (gpt-oss's ``ClampedSwiGLU``).
    ``bias``: each expert's projections have biases (gpt-oss), ``gate_up_proj_bias`` [E, 2I] and
    ``down_proj_bias`` [E, H]; an expert's output includes its down bias before the router weight scales it.
    """

    def __init__(self, rule: RoutingRule, hidden_size: int, intermediate_size: int,
                 act: str | Callable[[torch.Tensor], torch.Tensor] = "silu", *, dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "", bias: bool = False) -> None:
        super().__init__()
        tp = get_tp()
        # A GGUF file's experts arrive as each expert's raw blocks (``loader/gguf_file.iter_expert_tensors``): kept
        # as they are, one gguf layer per expert projection; split by columns across ranks they are dequantized
        # (a block is not cut) and run as float experts.
        self._gguf_blocks: dict[tuple[int, int], Any] | None = None
        if quant_config is not None and quant_config.name == "gguf":
            if tp.is_parallel and not tp.expert_parallel:
                quant_config = None
            else:
                self._gguf_blocks = {}
        # An fp8 checkpoint's experts (float8 weights with their scales) are kept per expert too, then bound as the
        # scheme's layers (the bytes unchanged); a block cannot be cut across ranks by columns.
        self._fp8_shards: dict[tuple[int, int], torch.Tensor] | None = None
        self._fp8_scales: dict[tuple[int, int], torch.Tensor] = {}
        if quant_config is not None and quant_config.name == "fp8" and getattr(quant_config, "checkpoint", False):
            if tp.is_parallel and not tp.expert_parallel:
                raise ValueError(f"{prefix}: an fp8 checkpoint's experts cannot be split by columns across ranks; "
                                 "use --enable-expert-parallel with --tensor-parallel-size")
            self._fp8_shards = {}
        self.rule, self.prefix, self.quant_config = rule, prefix, quant_config
        self.hidden_size = hidden_size
        self.tensor_parallel = tp.is_parallel
        # Expert parallelism: this rank's experts [first_expert, first_expert + num_local_experts), each whole;
        # else every expert, a slice of its intermediate dimension.
        self.expert_parallel = tp.is_parallel and tp.expert_parallel
        if self.expert_parallel:
            self.num_local_experts = divide(rule.num_experts, tp.world_size, f"{prefix}: number of experts")
            self.first_expert = tp.rank * self.num_local_experts
            self.part = Slice(0, intermediate_size, intermediate_size)
        else:
            self.num_local_experts, self.first_expert = rule.num_experts, 0
            self.part = even_part(intermediate_size, f"{prefix}: moe intermediate_size")  # this rank's slice of I
        num_experts, part = self.num_local_experts, self.part.size
        # Quantized and split by columns, down keeps whole rows until packing: a per-channel scale is the whole
        # row's, so each rank quantizes as one rank would (the codes of TP=1), then keeps its columns.
        self._down_whole_rows = quant_config is not None and part != self.part.full
        down_width = self.part.full if self._down_whole_rows else part
        kept_apart = self._gguf_blocks is not None or self._fp8_shards is not None
        stacks = 0 if kept_apart else num_experts  # GGUF blocks and fp8 checkpoint experts are kept apart
        self.gate_up_proj = set_weight_loader(
            nn.Parameter(torch.empty(stacks, 2 * part, hidden_size, dtype=dtype), requires_grad=False),
            self._load_gate_up)
        self.down_proj = set_weight_loader(
            nn.Parameter(torch.empty(stacks, hidden_size, down_width, dtype=dtype), requires_grad=False),
            self._load_down)
        if self._fp8_shards is not None:  # each expert projection's checkpoint scales (and unused input scales)
            scale = "_scale_inv" if quant_config.block else "_scale"
            for proj in ("gate_up_proj", "down_proj"):
                setattr(self, proj + scale, set_weight_loader(nn.Parameter(torch.empty(0), requires_grad=False),
                                                              self._load_fp8_scale))
                if quant_config.static_input_scale:
                    setattr(self, proj + "_input_scale", set_weight_loader(
                        nn.Parameter(torch.empty(0), requires_grad=False), lambda p, w, shard_id=None: None))
        self.act_and_mul = gated_activation(act) if isinstance(act, str) else act
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = set_weight_loader(
                nn.Parameter(torch.empty(num_experts, 2 * part, dtype=dtype), requires_grad=False),
                self._load_gate_up_bias)
            self.down_proj_bias = set_weight_loader(
                nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False),
                self._load_down_bias)
        # Set by process_weights_after_loading (one of the three forms; see the module docstring).
        self._kernels: Any = None  # the C++ kernels module of the panel form
        self._quantized: list[tuple[Linear, Linear]] | None = None  # per expert (gate_up, down) of the scheme
        self._stacked: tuple[StackedProjection, StackedProjection] | None = None  # quantized experts, stacked
        self._rows: tuple[StackedRows, StackedRows] | None = None  # quantized experts, stacked rows (Triton)
        self._triton = False  # the experts run Triton's grouped matmul (float stacks or ``_rows``)
        self.register_buffer("gate_up_proj_bf16", None, persistent=False)  # bf16 experts' stacked panels
        self.register_buffer("down_proj_bf16", None, persistent=False)
        self._scheme = ""  # the quantized experts' scheme, for describe()
        self._routes_in_kernels = False  # C++ experts with moe_route / moe_gather_rows / moe_combine
        self._processed = False

    # -- loading --------------------------------------------------------------------------------------------------
    def num_loaded_shards(self, param_name: str) -> int:
        """How many (expert, which) shards fill ``param_name`` from per-expert tensors (the loader's check)."""
        return self.rule.num_experts * (2 if param_name.startswith("gate_up_proj") else 1)

    def _kept(self) -> dict[tuple[int, int], Any] | None:
        """Where per-expert tensors wait for binding (GGUF blocks, an fp8 checkpoint's experts); None: stacked."""
        return self._gguf_blocks if self._gguf_blocks is not None else self._fp8_shards

    def _load_fp8_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        """One expert projection's fp8 checkpoint scale (``weight_scale_inv`` blocks or ``weight_scale``); shard
        (expert, GATE | UP) for gate / up, (expert, 0) for down, told apart by the parameter."""
        if shard_id is None:
            raise ValueError(f"{self.prefix}: fp8 scales of experts fused in one tensor are not supported")
        expert, which = shard_id
        which = DOWN if param is getattr(self, "down_proj_scale_inv", None) or param is getattr(
            self, "down_proj_scale", None) else which
        local = self._local(expert)
        if local is not None:
            self._fp8_scales[(local, which)] = loaded

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        """One expert's gate or up projection [I, H] (shard (expert, GATE | UP)), or all experts fused [E, 2I, H]
        with rows [gate | up] (shard None)."""
        full, part = self.part.full, self.part
        if shard_id is None:
            self._check(loaded, (self.rule.num_experts, 2 * full, self.hidden_size), "gate_up_proj")
            local = loaded.narrow(0, self.first_expert, self.num_local_experts)
            for which in (GATE, UP):
                rows = local.narrow(1, which * full + part.start, part.size)
                param.data.narrow(1, which * part.size, part.size).copy_(rows)
            return
        expert, which = shard_id
        loaded = self._checked(loaded, (full, self.hidden_size), f"{expert}.{('gate', 'up')[which]}_proj")
        local = self._local(expert)
        if local is not None and self._kept() is not None:
            self._kept()[(local, which)] = loaded
        elif local is not None:
            param.data[local].narrow(0, which * part.size, part.size).copy_(loaded.narrow(0, part.start, part.size))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        """One expert's down projection [H, I] (shard (expert, 0)), or all experts fused [E, H, I] (shard None)."""
        part = self.part
        start, size = (0, part.full) if self._down_whole_rows else (part.start, part.size)
        if shard_id is None:
            self._check(loaded, (self.rule.num_experts, self.hidden_size, part.full), "down_proj")
            local = loaded.narrow(0, self.first_expert, self.num_local_experts)
            param.data.copy_(local.narrow(2, start, size))
            return
        expert = shard_id[0]
        loaded = self._checked(loaded, (self.hidden_size, part.full), f"{expert}.down_proj")
        local = self._local(expert)
        if local is not None and self._kept() is not None:
            self._kept()[(local, DOWN)] = loaded
        elif local is not None:
            param.data[local].copy_(loaded.narrow(1, start, size))

    def _load_gate_up_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Every expert's gate and up biases fused, [E, 2I] laid out [gate | up]."""
        full, part = self.part.full, self.part
        self._check(loaded, (self.rule.num_experts, 2 * full), "gate_up_proj_bias")
        local = loaded.narrow(0, self.first_expert, self.num_local_experts)
        for which in (GATE, UP):
            param.data.narrow(1, which * part.size, part.size).copy_(local.narrow(1, which * full + part.start,
                                                                                  part.size))

    def _load_down_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Every expert's down bias, [E, H]. Split by intermediate columns across ranks, the down projections' partial
        sums are all-reduced, so only rank 0 adds the bias (the others hold zeros)."""
        self._check(loaded, (self.rule.num_experts, self.hidden_size), "down_proj_bias")
        if self.tensor_parallel and not self.expert_parallel and get_tp().rank != 0:
            param.data.zero_()
            return
        param.data.copy_(loaded.narrow(0, self.first_expert, self.num_local_experts))

    def _local(self, expert: int) -> int | None:
        """This rank's index of checkpoint expert ``expert``, None where another rank holds it."""
        if not 0 <= expert < self.rule.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert} is out of range (the config has {self.rule.num_experts})")
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def _check(self, loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{self.prefix}.{what}: expert weights of type {type(loaded).__name__} are not supported")
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{self.prefix}.{what}: checkpoint {tuple(loaded.shape)}, model {expected}")

    def _checked(self, loaded: Any, expected: tuple[int, ...], what: str) -> Any:
        """One expert's tensor, shape checked: GGUF blocks kept as they are where this layer keeps them, else
        dequantized to float."""
        if hasattr(loaded, "ggml_type"):  # a GGUFQuantTensor (raw blocks)
            if tuple(loaded.shape) != expected:
                raise ValueError(f"{self.prefix}.{what}: checkpoint {tuple(loaded.shape)}, model {expected}")
            return loaded if self._gguf_blocks is not None else loaded.dequantize()
        self._check(loaded, expected, what)
        return loaded

    def process_weights_after_loading(self) -> None:
        """Bind the experts' weights in the form their platform runs (the module docstring's three forms); the
        float stacks are dropped where another copy replaces them."""
        if self._processed:
            return
        self._processed = True
        weight = self.gate_up_proj
        if self._gguf_blocks is not None:  # a GGUF file's experts, each projection a gguf layer of its blocks
            experts = range(self.num_local_experts)
            gate_up = [self._bind_blocks([self._gguf_blocks.pop((e, GATE)), self._gguf_blocks.pop((e, UP))],
                                         "gate_up_proj") for e in experts]
            down = [self._bind_blocks([self._gguf_blocks.pop((e, DOWN))], "down_proj") for e in experts]
            self._keep_quantized(gate_up, down)
            return
        if self._fp8_shards is not None:  # an fp8 checkpoint's experts, each projection an fp8 layer of its bytes
            experts = range(self.num_local_experts)
            gate_up = [self._bind_fp8([(e, GATE), (e, UP)], "gate_up_proj") for e in experts]
            down = [self._bind_fp8([(e, DOWN)], "down_proj") for e in experts]
            self._keep_quantized(gate_up, down)
            return
        if self.quant_config is None and triton_experts_for(weight):
            self._triton = True  # the float stacks, as they are
            return
        on_host = not platform_of(weight).is_accelerator
        if self.quant_config is None and on_host and weight.dtype == torch.bfloat16 and self._stack_bf16():
            return
        # Per-expert layers: a quantization scheme's packed weights, or on the CPU bf16's own forms (oneDNN's
        # prepacked layout / bf16 panels: torch's grouped matmul would repack every expert's weight on each call).
        if self.quant_config is not None or (on_host and weight.dtype != torch.float32):
            experts = range(self.num_local_experts)
            gate_up = [self._bind_expert(self.gate_up_proj[e], "gate_up_proj") for e in experts]
            down = [self._bind_expert(self.down_proj[e], "down_proj", self.part if self._down_whole_rows else None)
                    for e in experts]
            self._keep_quantized(gate_up, down)
            self._drop_stacks()
            return
        kernels = platform_of(weight).cpu_kernels(weight.dtype) if weight.dtype == torch.float32 else None
        if kernels is not None and hasattr(kernels, "moe_packed_gemm"):
            self._stack_panels(pack_weight, "panels")
            self._kernels = kernels
            # The routing kernels too (a build that has them), except under expert parallelism (other ranks'
            # experts are masked out in torch).
            self._routes_in_kernels = hasattr(kernels, "moe_route") and not self.expert_parallel
            self._drop_stacks()

    def _stack_bf16(self) -> bool:
        """bf16 experts on a CPU with AVX-512 BF16: every expert's projections packed as bf16_gemm's panels and
        stacked, for one ``moe_bf16_gemm`` call per projection; False (nothing changed) where that cannot run."""
        kernels = platform_of(self.gate_up_proj).cpu_kernels(torch.float32)
        if (kernels is None or not hasattr(kernels, "moe_bf16_gemm") or not kernels.bf16_gemm_supported()
                or self.hidden_size % 2 or self.down_proj.shape[-1] % 2):
            return False
        self._stack_panels(pack_bf16_weight, "bf16")
        self._kernels = kernels
        self._routes_in_kernels = hasattr(kernels, "moe_route") and not self.expert_parallel
        self._drop_stacks()
        return True

    def _stack_panels(self, pack: Callable[[torch.Tensor], torch.Tensor], suffix: str) -> None:
        """Each expert's two projections packed by ``pack`` and stacked [E, ...] into buffers ``{name}_{suffix}``."""
        for name in ("gate_up_proj", "down_proj"):
            stack = getattr(self, name)
            panels = torch.stack([pack(stack[e]) for e in range(stack.shape[0])])
            self.register_buffer(f"{name}_{suffix}", panels, persistent=False)

    def _keep_quantized(self, gate_up: list[Linear], down: list[Linear]) -> None:
        """The experts' per-projection layers, stacked for ``moe_quant_gemm`` where the C++ kernels run them (float32
        activations on the CPU, every expert in one panel format), else kept as layers called one by one."""
        self._scheme = gate_up[0].quant_method.scheme(gate_up[0])
        weight = self.gate_up_proj
        if triton_experts_for(weight):
            rows = (stack_rows(gate_up), stack_rows(down))
            if rows[0] is not None and rows[1] is not None:
                self._rows, self._triton = rows, True  # the layers (and their copies) are dropped
                return
        kernels = None
        if not platform_of(weight).is_accelerator and weight.dtype == torch.float32:
            kernels = platform_of(weight).cpu_kernels(torch.float32)
        if kernels is not None and hasattr(kernels, "moe_quant_gemm"):
            stacked = (stack_projection(gate_up), stack_projection(down))
            if stacked[0] is not None and stacked[1] is not None:
                self._stacked, self._kernels = stacked, kernels  # the layers (and their copies) are dropped
                self._routes_in_kernels = hasattr(kernels, "moe_route") and not self.expert_parallel
                return
        # Registered, so the memory report and the CPU kernel autotuner see them like any Linear.
        self.experts_gate_up, self.experts_down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self._quantized = list(zip(gate_up, down, strict=True))

    def _drop_stacks(self) -> None:
        """The float stacks become empty: another copy of the experts is the weight from here on."""
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(torch.empty(0, dtype=getattr(self, name).dtype), requires_grad=False))

    def experts_weight_nbytes(self) -> int:
        """Bytes of the experts held by this module itself (stacks or panels; quantized experts are Linear layers
        of their own, reported as such)."""
        stacked = sum(s.nbytes() for s in self._stacked or self._rows or ())
        return stacked + sum(t.numel() * t.element_size() for t in [*self.parameters(recurse=False),
                                                                    *self.buffers(recurse=False)])

    def describe(self) -> str:
        """The experts' weight form ("float32 panels (moe_packed_gemm)", "int8 per-channel per expert",
        "unquantized bfloat16 (oneDNN packed) per expert", "int8 per-channel stacked (moe_quant_gemm)",
        "int8 per-channel stacked rows (triton)", "bfloat16 grouped (triton)", "float16 grouped_mm")."""
        if self._rows is not None:
            return f"{self._scheme} stacked rows (triton)"
        if self._triton:
            return f"{str(self.gate_up_proj.dtype).removeprefix('torch.')} grouped (triton)"
        if self._stacked is not None:
            return f"{self._scheme} stacked (moe_quant_gemm)"
        if self.gate_up_proj_bf16 is not None:
            return "bfloat16 panels stacked (moe_bf16_gemm)"
        if self._quantized is not None:
            return f"{self._scheme} per expert"
        if self._kernels is not None:
            return "float32 panels (moe_packed_gemm)"
        return f"{str(self.gate_up_proj.dtype).removeprefix('torch.')} grouped_mm"

    def _bind_expert(self, weight: torch.Tensor, name: str, columns: Slice | None = None) -> Linear:
        """A Linear of the model's quantization scheme holding ``weight`` [N, K], packed for its kernel; with
        ``columns``, only those input columns of ``weight``, quantized with the whole rows' scales where the
        scheme's scale is per row (``load_input_slice``)."""
        n, k = weight.shape[0], columns.size if columns is not None else weight.shape[1]
        with torch.device("meta"):
            layer = Linear(k, n, bias=False, dtype=weight.dtype, quant_config=self.quant_config,
                           prefix=f"{self.prefix}.{name}")
        layer = to_empty_keeping_loaders(layer, weight.device)
        whole_rows = getattr(layer.quant_method, "load_input_slice", None)
        if columns is None:
            layer.weight.weight_loader(layer.weight, weight.detach(), None)
        elif whole_rows is None or not whole_rows(layer, weight.detach(), columns, None):
            layer.weight.weight_loader(layer.weight, weight.detach().narrow(1, columns.start, columns.size), None)
        layer.process_weights_after_loading()
        return layer

    def _bind_blocks(self, shards: list[Any], name: str) -> Linear:
        """A gguf-scheme Linear over one expert's projection given as its row shards (raw blocks or float); a
        projection the file stores in float (any width) is a float layer, as kept-quantized files' float matrices."""
        sizes = tuple(t.shape[0] for t in shards)
        quantized = any(hasattr(t, "ggml_type") for t in shards)
        with torch.device("meta"):
            layer = Linear(shards[0].shape[1], sum(sizes), bias=False, dtype=self.gate_up_proj.dtype,
                           quant_config=self.quant_config if quantized else None,
                           shard_sizes=sizes if len(sizes) > 1 else None, prefix=f"{self.prefix}.{name}")
        layer = to_empty_keeping_loaders(layer, self.gate_up_proj.device)
        for shard_id, t in enumerate(shards):
            layer.weight.weight_loader(layer.weight, t, shard_id if len(shards) > 1 else None)
        layer.process_weights_after_loading()
        return layer

    def _bind_fp8(self, keys: list[tuple[int, int]], name: str) -> Linear:
        """An fp8-scheme Linear over one expert's projection from its checkpoint shards (float8 bytes and scales,
        ``keys`` into the kept tensors), packed as the dense fp8 layers are."""
        shards = [self._fp8_shards.pop(k) for k in keys]
        missing = [k for k in keys if k not in self._fp8_scales]
        if missing:
            raise ValueError(f"{self.prefix}: expert {missing[0][0] + self.first_expert} {name} has float8 weights "
                             "but no scale in the checkpoint")
        scales = [self._fp8_scales.pop(k) for k in keys]
        sizes = tuple(t.shape[0] for t in shards)
        with torch.device("meta"):
            layer = Linear(shards[0].shape[1], sum(sizes), bias=False, dtype=self.gate_up_proj.dtype,
                           quant_config=self.quant_config, shard_sizes=sizes if len(sizes) > 1 else None,
                           prefix=f"{self.prefix}.{name}")
        layer = to_empty_keeping_loaders(layer, self.gate_up_proj.device)
        scale_param = getattr(layer, "weight_scale_inv" if self.quant_config.block else "weight_scale")
        for shard_id, (t, s) in enumerate(zip(shards, scales, strict=True)):
            sid = shard_id if len(shards) > 1 else None
            layer.weight.weight_loader(layer.weight, t, sid)
            scale_param.weight_loader(scale_param, s, sid)
        layer.process_weights_after_loading()
        return layer

    # -- forward --------------------------------------------------------------------------------------------------
    def routes_in_kernels(self, x: torch.Tensor, router_logits: torch.Tensor) -> bool:
        """Whether this call (x [T, H], router_logits [T, E]) runs entirely in the C++ kernels
        (``_forward_kernels``)."""
        kinds = (torch.float32, torch.bfloat16)
        return (self._routes_in_kernels and self.rule.plain and router_logits.dtype in kinds and x.dtype in kinds
                and x.stride(-1) == 1)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] in x's dtype. ``shared``: (a shared expert's output [T, H], its
        gate logits [T, 1]) to add as ``sigmoid(gate) * output`` (Qwen2-MoE), after the experts' all-reduce under
        tensor parallelism (the shared expert all-reduces its own output, so every rank adds the whole of it).
        ``correction_bias`` [E]: the router's score correction (``sigmoid_topk``, DeepSeek-V3)."""
        if correction_bias is None and self.routes_in_kernels(x, router_logits):
            return self._forward_kernels(x, router_logits, shared)
        weights, ids = select_experts(router_logits, self.rule, correction_bias)
        if self.expert_parallel:  # other ranks' experts go to a bucket past this rank's, which is then left out
            ids = ids - self.first_expert
            ids = ids.masked_fill((ids < 0) | (ids >= self.num_local_experts), self.num_local_experts)
            groups = group_by_expert(weights, ids, self.num_local_experts + 1).first_experts(self.num_local_experts)
        else:
            groups = group_by_expert(weights, ids, self.rule.num_experts)
        if self._triton:
            out = self._experts_triton(x, groups)
        else:
            rows = x.index_select(0, groups.token_of)  # [R, H]: each token once per chosen expert, by expert
            if self._kernels is not None:
                y = self._experts_kernels(rows, groups)
            elif self._quantized is not None:
                y = self._experts_quantized(rows, groups)
            else:
                y = self._experts_grouped(rows, groups)
            out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
            out.index_add_(0, groups.token_of, y.float() * groups.weight)
            out = out.to(x.dtype)
        out = all_reduce(out) if self.tensor_parallel else out
        return out if shared is None else out + torch.sigmoid(shared[1]) * shared[0]

    def _forward_kernels(self, x: torch.Tensor, router_logits: torch.Tensor,
                         shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The C++ experts (float32 panels or stacked quantized panels) with the routing in C++ too
        (``moe_route.cpp``: top-k, the sort by expert, the gather of rows, the weighted sum back), every result in a
        tensor allocated here: a decode step of a model made of such layers is nothing but kernel calls, which a CPU
        step graph records. x [T, H] -> [T, H]."""
        kernels, rule = self._kernels, self.rule
        t, num_rows = x.shape[0], x.shape[0] * rule.top_k
        token_of = torch.empty(num_rows, dtype=torch.int64, device=x.device)
        weight = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
        ends = torch.empty(rule.num_experts, dtype=torch.int32, device=x.device)
        kernels.moe_route(router_logits, rule.top_k, rule.scoring == "topk_softmax", rule.renormalize, token_of,
                          weight, ends)
        rows = torch.empty(num_rows, self.hidden_size, dtype=x.dtype, device=x.device)
        kernels.moe_gather_rows(x, token_of, rows)
        y = self._experts_kernels(rows, ExpertGroups(token_of, weight, ends))
        out = torch.empty(t, self.hidden_size, dtype=x.dtype, device=x.device)
        if shared is not None and not self.tensor_parallel:
            kernels.moe_combine(y, token_of, weight, out, shared[0], shared[1])
            return out
        kernels.moe_combine(y, token_of, weight, out)
        out = all_reduce(out) if self.tensor_parallel else out
        return out if shared is None else out + torch.sigmoid(shared[1]) * shared[0]

    def _row_bias(self, bias: torch.Tensor | None, ends: torch.Tensor, num_rows: int) -> torch.Tensor | None:
        """bias [E, N] -> each sorted row's expert's bias [R, N] (None without biases)."""
        if bias is None:
            return None
        counts = torch.diff(ends.to(torch.int64), prepend=ends.new_zeros(1, dtype=torch.int64))
        return bias.repeat_interleave(counts.to(bias.device), dim=0, output_size=num_rows)

    def _experts_kernels(self, rows: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """float32 or stacked quantized panels: rows [R, H] sorted by expert -> [R, H], two C++ calls threading over
        (expert, panels)."""
        bf16 = self.gate_up_proj_bf16 is not None
        if self._stacked is not None:
            gate_up_w, down_w = self._stacked
            gate_up = gate_up_w(self._kernels, rows, groups.ends)
        elif bf16:
            gate_up = self._kernels.moe_bf16_gemm(rows, self.gate_up_proj_bf16, groups.ends, 2 * self.part.size)
        else:
            gate_up = self._kernels.moe_packed_gemm(rows, self.gate_up_proj_panels, groups.ends, 2 * self.part.size)
        if self.gate_up_proj_bias is not None:
            gate_up += self._row_bias(self.gate_up_proj_bias, groups.ends, rows.shape[0])
        hidden = self.act_and_mul(gate_up)
        if self._stacked is not None:
            y = down_w(self._kernels, hidden, groups.ends)
        elif bf16:
            y = self._kernels.moe_bf16_gemm(hidden, self.down_proj_bf16, groups.ends, self.hidden_size)
        else:
            y = self._kernels.moe_packed_gemm(hidden, self.down_proj_panels, groups.ends, self.hidden_size)
        if self.down_proj_bias is not None:
            y += self._row_bias(self.down_proj_bias, groups.ends, rows.shape[0])
        return y

    def _experts_grouped(self, rows: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Float stacks: rows [R, H] sorted by expert -> each row through its expert's MLP, [R, H]."""
        ends = groups.ends.to(rows.device)
        gate_up = grouped_matmul(rows, self.gate_up_proj, ends)
        if self.gate_up_proj_bias is not None:
            gate_up += self._row_bias(self.gate_up_proj_bias, ends, rows.shape[0])
        y = grouped_matmul(self.act_and_mul(gate_up), self.down_proj, ends)
        if self.down_proj_bias is not None:
            y += self._row_bias(self.down_proj_bias, ends, rows.shape[0])
        return y

    def _experts_triton(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Triton's grouped matmul (float stacks or stacked rows): x [T, H] -> the k experts' outputs weighted and
        summed per token, [T, H] in x's dtype; launches only, no host synchronisation."""
        num_rows = groups.num_rows
        tiles = expert_tiles(groups.ends, num_rows, block_m_for(num_rows, groups.ends.numel()))
        gate_up_w, down_w = self._rows if self._rows is not None else (self.gate_up_proj, self.down_proj)
        gate_up = moe_grouped_matmul(x, gate_up_w, tiles, num_rows, token_of=groups.token_of,
                                     bias=self.gate_up_proj_bias)
        y = moe_grouped_matmul(self.act_and_mul(gate_up), down_w, tiles, num_rows, bias=self.down_proj_bias)
        return moe_combine(y, groups.slot_rows(), groups.weight, x.shape[0], self.rule.top_k, x.dtype)

    def _experts_quantized(self, rows: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Per-expert layers: each expert with rows this step multiplies its run of ``rows`` [R, H] -> [R, H]. The
        loop calls only the experts that have rows (k per token at most)."""
        y = torch.empty(rows.shape[0], self.hidden_size, dtype=rows.dtype, device=rows.device)
        ends = groups.ends.tolist()
        start = 0
        for expert, end in enumerate(ends):
            if end > start:
                gate_up, down = self._quantized[expert]
                run = y[start:end]
                hidden = gate_up(rows[start:end])
                if self.gate_up_proj_bias is not None:
                    hidden = hidden + self.gate_up_proj_bias[expert]
                got = down(self.act_and_mul(hidden), run)  # written into y where the form can
                if got.data_ptr() != run.data_ptr():
                    run.copy_(got)
                if self.down_proj_bias is not None:
                    run += self.down_proj_bias[expert]
            start = end
        return y

    def extra_repr(self) -> str:
        r = self.rule
        return (f"experts={r.num_experts}, top_k={r.top_k}, scoring={r.scoring}, renormalize={r.renormalize}, "
                f"hidden={self.hidden_size}, intermediate={self.part.size}/{self.part.full}, "
                f"bias={self.down_proj_bias is not None}")
