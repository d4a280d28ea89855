"""What every causal LM shares: the LM head (tied or not; packed or quantized like any layer), logit softcapping,
and loading through the generic loader with the model's ``weight_mapping``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.parallel_linear import column_parallel_linear, gather_logits, padded_vocab_part
from pagedllm.model_executor.layers.quantization.base import to_empty_keeping_loaders
from pagedllm.model_executor.models.blocks import make_linear
from pagedllm.model_executor.models.weight_loading import WeightMapping, load_weights
from pagedllm.platforms import platform_of


class CausalLM(DirectCall, nn.Module):
    """Subclasses build ``self.model`` (whose forward takes ``input_ids, positions``) and call
    ``_init_head``; they name the input embedding in ``embedding_name`` and declare ``weight_mapping``."""

    weight_mapping: WeightMapping = WeightMapping()
    embedding_name = "model.embed_tokens"
    head_name = "lm_head.weight"

    def _init_head(self, hf_config: Any, dtype: torch.dtype, quant_config: Any = None) -> None:
        self.config = hf_config
        self.dtype = dtype
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Under tensor parallelism the head is split by vocabulary rows and the logits gathered (compute_logits).
        self.tensor_parallel = get_tp().is_parallel
        self.lm_head = None if self.tie_word_embeddings else self._make_head(hf_config.hidden_size,
                                                                             hf_config.vocab_size, dtype, quant_config)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        self.quant_config = quant_config
        # The tied head's own copy of the embedding rows, packed or quantized (the embedding keeps reading
        # the plain rows); built by process_weights_after_loading.
        self._tied_head: Linear | None = None

    def _make_head(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, quant_config: Any) -> Linear:
        if self.tensor_parallel:
            return column_parallel_linear(hidden_size, (padded_vocab_part(vocab_size),), bias=False, dtype=dtype,
                                          quant_config=quant_config, prefix="lm_head")
        return make_linear(hidden_size, vocab_size, bias=False, dtype=dtype, quant_config=quant_config,
                           prefix="lm_head")

    def embedding(self) -> nn.Embedding:
        return self.get_submodule(self.embedding_name)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size] (model dtype).

        Must run inside ``forward_context(attn_metadata)`` with KV caches bound (``bind_kv_caches``).
        """
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, hidden_size] (usually only the rows that sample) -> logits [N, vocab] float32.

        ``out``: an optional [N, vocab] float32 buffer the CPU kernel writes into (the result is then
        ``out``); other paths allocate.
        """
        if self.tensor_parallel:
            out = None  # each rank computes its vocabulary rows; the gathered logits are a new tensor
        if self.lm_head is not None:
            logits = self.lm_head(hidden, out=out).float()
        elif self._tied_head is not None:
            logits = self._tied_head(hidden, out=out).float()
        else:
            logits = F.linear(hidden, self.embedding().weight).float()
        if self.tensor_parallel:
            logits = gather_logits(logits, self.config.vocab_size)
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap, out=logits if logits is out else None) * cap
        return logits

    def process_weights_after_loading(self) -> None:
        """After loading: the tied LM head as its own ``Linear`` (a packed copy: fp32 panels, bf16 for oneDNN, or
        quantized) where that pays, i.e. where linear weights are repacked or a quantization scheme applies;
        elsewhere F.linear on the rows."""
        if not self.tie_word_embeddings or self._tied_head is not None:
            return
        embedding = self.embedding().weight
        if self.quant_config is None and not platform_of(embedding).packs_linear_weights(embedding.dtype):
            return  # plain F.linear on the embedding rows: no second copy
        with torch.device("meta"):  # no random init of a vocab-sized matrix that is overwritten next
            # Under tensor parallelism the embedding holds this rank's vocabulary rows: the head takes them as is.
            head = make_linear(self.config.hidden_size, embedding.shape[0], bias=False, dtype=embedding.dtype,
                               quant_config=self.quant_config, prefix="lm_head")
        head = to_empty_keeping_loaders(head, embedding.device)
        head.weight.weight_loader(head.weight, embedding.detach())
        head.process_weights_after_loading()
        self._tied_head = head

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through the generic loader; a tied checkpoint's head is skipped."""
        skip = (self.head_name,) if self.tie_word_embeddings else ()
        return load_weights(self, weights, self.weight_mapping, skip_names=skip)
