"""``TransformersForCausalLM`` / ``TransformersEncoderModel``: a transformers causal LM (or, for ``--runner pooling``,
an encoder) run by pagedllm's engine (``--model-impl transformers``).

The transformers model keeps its own layers (norms, MLPs, rotary, QK norms, multipliers); only its attention calls
go to pagedllm's paged attention (``attention.py``). The engine sees what it sees of a native model:

- ``forward(input_ids[T], positions[T]) -> hidden[T, hidden]``: the flat batch as a batch of one sequence of T
  tokens, ``positions`` as ``position_ids``; every request's tokens attend only to their own request's K/V because
  the backends read the step's metadata (slot mapping, block tables), not a mask.
- ``compute_logits(hidden[N, hidden]) -> [N, vocab]`` float32: the output embedding and the scalings transformers
  applies after it (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2's final soft cap).
- one pagedllm ``Attention`` per layer (``attn_layers``), whose heads, head size, scale and window come from a
  probe forward (``build_attention_layers``): the worker sizes and binds the KV cache through them.

An encoder (BERT-like, ``is_encoder_only``) keeps no KV cache: its layers are encoder-kind ``Attention`` layers
over whole prompts, each request's tokens attending to its own (the pooling runner's metadata).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from pagedllm.model_executor.layers.attention import Attention
from pagedllm.model_executor.models.transformers_fallback.attention import (
    AttentionProbe,
    LayerCall,
    PagedLayers,
    use_attention_handler,
)


class _TransformersModel(nn.Module):
    """What the causal and the encoder fallbacks share: the probe, the attention layers, the forward."""

    #: What the worker reads: decode steps run eagerly (the transformers forward is Python and torch ops that
    #: neither a CUDA graph capture without compilation nor a CPU step graph of C++ kernels can record).
    model_impl = "transformers"
    is_encoder_only = False

    def __init__(self, hf_model: nn.Module, architecture: str) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = hf_model.config.get_text_config()
        self.architecture = architecture
        self.dtype = next(hf_model.parameters()).dtype
        self.attn_layers = nn.ModuleList()
        self._paged = PagedLayers([])
        self.position_offset = 0  # added to each token's position (RoBERTa's start after the padding index)
        # No transformers KV cache (pagedllm's is paged) and a ModelOutput, where the forward takes them.
        params = inspect.signature(self.base_model().forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._extra_kwargs = {k: v for k, v in (("use_cache", False), ("return_dict", True))
                              if takes_any or k in params}

    def base_model(self) -> nn.Module:
        """The decoder stack (transformers' ``base_model``: embeddings, layers, final norm)."""
        return self.hf_model.base_model

    @torch.inference_mode()
    def build_attention_layers(self) -> list[LayerCall]:
        """Run a two-token forward through the probe and give each attention layer a pagedllm ``Attention`` with
        what it passed. Returns the layers' calls in layer order. ValueError for what the backends cannot do."""
        probe = AttentionProbe(self.architecture)
        device = next(self.hf_model.parameters()).device
        ids = torch.zeros(2, dtype=torch.long, device=device)
        with use_attention_handler(probe):
            self._run(ids, torch.arange(2, device=device))
        num_layers = len(probe.calls)
        if num_layers == 0 or sorted(probe.calls) != list(range(num_layers)):
            raise ValueError(f"model: {self.architecture} through the transformers fallback: its attention layers "
                             f"reported layer indices {sorted(probe.calls)}, not 0..n-1")
        calls = [probe.calls[i] for i in range(num_layers)]
        if any(c.is_causal == self.is_encoder_only for c in calls):
            want = "bidirectional (an encoder)" if self.is_encoder_only else "causal (a decoder)"
            raise ValueError(f"model: {self.architecture} through the transformers fallback: not every attention "
                             f"layer is {want}, as this model class expects")
        if self.is_encoder_only and any(c.sliding_window for c in calls):
            raise ValueError(f"model: {self.architecture} through the transformers fallback: local (sliding-window) "
                             "attention in an encoder is not supported by pagedllm's encoder attention")
        if len({(c.num_kv_heads, c.head_size) for c in calls}) > 1:
            raise ValueError(f"model: {self.architecture} through the transformers fallback: its layers differ in "
                             "KV heads or head size, which pagedllm's KV cache (one shape for all layers) cannot hold")
        self.attn_layers = nn.ModuleList(
            Attention(c.num_heads, c.head_size, c.scale, c.num_kv_heads, layer_idx=i, spec=c.spec())
            for i, c in enumerate(calls))
        self._paged = PagedLayers(list(self.attn_layers))
        return calls

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        position_ids = positions + self.position_offset if self.position_offset else positions
        out = self.base_model()(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                                **self._extra_kwargs)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size] after the final norm.

        Must run inside ``forward_context(attn_metadata)`` with KV caches bound (``bind_kv_caches``)."""
        with use_attention_handler(self._paged):
            return self._run(input_ids, positions)


class TransformersForCausalLM(_TransformersModel):
    """A transformers ``*ForCausalLM`` (``hf_model``, weights loaded) driven through pagedllm's paged attention."""

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab] float32 (``out`` is not used: a new tensor)."""
        logits = self.hf_model.get_output_embeddings()(hidden).float()
        cfg = self.config
        logit_scale = getattr(self.hf_model, "logit_scale", None)  # Cohere: multiplied
        if isinstance(logit_scale, (int, float)) and logit_scale != 1:
            logits = logits * logit_scale
        logits_scaling = getattr(cfg, "logits_scaling", None)  # Granite: divided
        if logits_scaling and logits_scaling != 1:
            logits = logits / logits_scaling
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits[:, :cfg.vocab_size] if logits.shape[-1] > cfg.vocab_size else logits


class TransformersEncoderModel(_TransformersModel):
    """A transformers encoder's base model (``BertModel``, ``RobertaModel``, ...) for the pooling runner: hidden
    states of whole prompts, no KV cache, no logits."""

    is_encoder_only = True

    def __init__(self, hf_model: nn.Module, architecture: str) -> None:
        super().__init__(hf_model, architecture)
        # RoBERTa-style embeddings number positions from padding_idx + 1 (transformers derives them from the ids).
        padding_idx = getattr(getattr(hf_model, "embeddings", None), "padding_idx", None)
        self.position_offset = padding_idx + 1 if isinstance(padding_idx, int) else 0

    def base_model(self) -> nn.Module:
        return self.hf_model  # built from the base class already (AutoModel's)
