"""GGUF architectures other than llama and gemma3: Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Phi-3, GPT-2.

Each is a table: metadata -> transformers config, GGUF tensor names -> HF checkpoint names. Facts from
llama.cpp's converter (``convert_hf_to_gguf.py``) that the tables rest on:
- Only the llama architecture has its q/k rows permuted (rotary pairs interleaved); Qwen2/3 and Phi-3
  rotate rotate-half ("NeoX") style and are stored as in the HF checkpoint, so nothing is un-permuted here.
- Phi-3 keeps q/k/v fused (``attn_qkv``) and gate/up fused (``ffn_up``, rows [gate | up]); LongRoPE's
  factors are tensors (``rope_factors_short`` / ``rope_factors_long``), its original context a metadata key.
- GPT-2's Conv1D weights ([in, out]) are transposed to [out, in] by the converter, and the tied head is
  written out as ``output.weight``.
- Qwen2-MoE / Qwen3-MoE store each layer's experts as one tensor per projection (``ffn_gate_exps`` /
  ``ffn_up_exps`` / ``ffn_down_exps``, [E, rows, cols] in torch order), the router as ``ffn_gate_inp`` (F32);
  Qwen2-MoE's shared expert as ``ffn_{gate,up,down}_shexp`` and its gate as ``ffn_gate_inp_shexp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.model_executor.loader.gguf_file import GGUFFile, block_part, gguf_hf_name, iter_expert_tensors

LLAMA_LIKE_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_LIKE_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture maps onto our model: ``layer_names`` (GGUF block part -> HF name under
    ``layer_prefix.N``), ``global_names``, ``skip`` (tensors read into the config instead), ``transposed``
    (HF names stored [in, out] in the checkpoint, i.e. GPT-2's Conv1D, which the model transposes on load:
    GGUF has them [out, in], so float tensors are handed over transposed back; raw quantized blocks are
    never transposed by the loader)."""

    hf_architecture: str
    config: Callable[[GGUFFile], Any]
    layer_names: dict[str, str]
    global_names: dict[str, str]
    layer_prefix: str = "model.layers"
    skip: tuple[str, ...] = ()
    transposed: tuple[str, ...] = ()
    # GGUF part stored fused -> HF names of its row blocks: kept-quantized blocks are handed over per block,
    # since a quantized fused layer takes its shards one by one.
    fused: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # MoE parts stored as one [E, rows, cols] tensor per layer (``ffn_gate_exps``): handed over one
    # ``...experts.{e}.<name>.weight`` per expert, as an HF checkpoint stores them (raw blocks when kept quantized).
    per_expert: tuple[str, ...] = ()
    # Parts always handed over as float (the MoE router: few rows, decisive for routing).
    float_parts: tuple[str, ...] = ()

    def hf_name(self, gguf_name: str) -> str:
        """``blk.3.attn_qkv.weight`` -> ``model.layers.3.self_attn.qkv_proj.weight`` (ValueError if unknown)."""
        return gguf_hf_name(gguf_name, self.layer_names, self.global_names, self.hf_architecture, self.layer_prefix)


class _Meta:
    """``{arch}.key`` metadata lookups with clear errors for required keys."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self.arch = gguf.metadata.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        return self.gguf.metadata.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"model: {self.gguf.path}: GGUF metadata {self.arch}.{key} is missing")
        return value

    def vocab_size(self) -> int:
        md = self.gguf.metadata
        return int(self.get("vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
                   or self.gguf.tensors["token_embd.weight"].shape[1])

    def token_ids(self) -> dict[str, Any]:
        md = self.gguf.metadata
        return {"bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
                "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
                "pad_token_id": md.get("tokenizer.ggml.padding_token_id")}

    def rope_parameters(self) -> dict[str, Any]:
        """rope base plus the scaling llama.cpp records in metadata: none, linear or YaRN."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.get("rope.freq_base", 10000.0))}
        kind = self.get("rope.scaling.type")
        if kind == "linear":
            rope.update(rope_type="linear", factor=float(self.need("rope.scaling.factor")))
        elif kind == "yarn":
            rope.update(rope_type="yarn", factor=float(self.need("rope.scaling.factor")),
                        original_max_position_embeddings=int(self.need("rope.scaling.original_context_length")))
        elif kind not in (None, "none"):
            raise ValueError(f"model: {self.gguf.path}: GGUF rope scaling {kind!r} is not supported for "
                             f"{self.arch} (none, linear, yarn)")
        return rope

    def decoder_common(self) -> dict[str, Any]:
        """The keys every Llama-shaped decoder config shares."""
        heads = int(self.need("attention.head_count"))
        hidden = int(self.need("embedding_length"))
        return dict(vocab_size=self.vocab_size(), hidden_size=hidden,
                    intermediate_size=int(self.need("feed_forward_length")),
                    num_hidden_layers=int(self.need("block_count")), num_attention_heads=heads,
                    num_key_value_heads=int(self.get("attention.head_count_kv", heads)),
                    rms_norm_eps=float(self.get("attention.layer_norm_rms_epsilon", 1e-6)),
                    max_position_embeddings=int(self.get("context_length", 2048)),
                    tie_word_embeddings="output.weight" not in self.gguf.tensors, **self.token_ids())


def gguf_rope_parameters(gguf: GGUFFile) -> dict[str, Any]:
    """transformers ``rope_parameters`` from a file's ``{arch}.rope.*`` metadata (none, linear or YaRN)."""
    return _Meta(gguf).rope_parameters()


def _check_full_rotary(meta: _Meta, head_dim: int) -> None:
    rot = meta.get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"model: {meta.gguf.path}: partial rotary ({rot} of {head_dim} dims) is not supported")


def _qwen2_config(gguf: GGUFFile) -> Any:
    from transformers import Qwen2Config

    meta = _Meta(gguf)
    common = meta.decoder_common()
    _check_full_rotary(meta, common["hidden_size"] // common["num_attention_heads"])
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], rope_parameters=meta.rope_parameters(), **common)


def _qwen3_config(gguf: GGUFFile) -> Any:
    from transformers import Qwen3Config

    meta = _Meta(gguf)
    common = meta.decoder_common()
    head_dim = int(meta.get("attention.key_length", common["hidden_size"] // common["num_attention_heads"]))
    _check_full_rotary(meta, head_dim)
    return Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=head_dim, attention_bias="blk.0.attn_q.bias"
                       in gguf.tensors, rope_parameters=meta.rope_parameters(), **common)


def _phi3_config(gguf: GGUFFile) -> Any:
    """Phi-3: sliding window when the metadata says so (0 means none: Phi-4), LongRoPE from its tensors."""
    from transformers import Phi3Config

    meta = _Meta(gguf)
    common = meta.decoder_common()
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    _check_full_rotary(meta, head_dim)
    original = int(meta.get("rope.scaling.original_context_length", common["max_position_embeddings"]))
    rope = meta.rope_parameters()
    if "rope_factors_long.weight" in gguf.tensors:
        rope = {"rope_type": "longrope", "rope_theta": rope["rope_theta"],
                "short_factor": gguf.load("rope_factors_short.weight").astype(np.float64).tolist(),
                "long_factor": gguf.load("rope_factors_long.weight").astype(np.float64).tolist(),
                "original_max_position_embeddings": original}
        if meta.get("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(meta.get("rope.scaling.attn_factor"))
    window = int(meta.get("attention.sliding_window", 0) or 0)
    return Phi3Config(architectures=["Phi3ForCausalLM"], original_max_position_embeddings=original,
                      sliding_window=window or None, rope_parameters=rope, **common)


def _gpt2_config(gguf: GGUFFile) -> Any:
    from transformers import GPT2Config

    meta = _Meta(gguf)
    hidden = int(meta.need("embedding_length"))
    return GPT2Config(architectures=["GPT2LMHeadModel"], vocab_size=meta.vocab_size(), n_embd=hidden,
                      n_layer=int(meta.need("block_count")), n_head=int(meta.need("attention.head_count")),
                      n_positions=int(meta.need("context_length")),
                      n_inner=int(meta.get("feed_forward_length", 4 * hidden)),
                      layer_norm_epsilon=float(meta.get("attention.layer_norm_epsilon", 1e-5)),
                      activation_function="gelu_new",  # llama.cpp's GPT-2 graph: tanh-approximated GELU
                      tie_word_embeddings="output.weight" not in gguf.tensors, **meta.token_ids())


def _qwen3moe_config(gguf: GGUFFile) -> Any:
    """Qwen3-MoE: Qwen3's attention; experts from ``expert_count`` / ``expert_used_count`` /
    ``expert_feed_forward_length``; the k weights renormalised unless ``expert_weights_norm`` is false (llama.cpp's
    qwen3moe graph renormalises)."""
    from transformers import Qwen3MoeConfig

    meta = _Meta(gguf)
    common = meta.decoder_common()
    head_dim = int(meta.get("attention.key_length", common["hidden_size"] // common["num_attention_heads"]))
    _check_full_rotary(meta, head_dim)
    return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], head_dim=head_dim,
                          attention_bias="blk.0.attn_q.bias" in gguf.tensors, rope_parameters=meta.rope_parameters(),
                          num_experts=int(meta.need("expert_count")),
                          num_experts_per_tok=int(meta.need("expert_used_count")),
                          moe_intermediate_size=int(meta.need("expert_feed_forward_length")),
                          norm_topk_prob=bool(meta.get("expert_weights_norm", True)), **common)


def _qwen2moe_config(gguf: GGUFFile) -> Any:
    """Qwen2-MoE: Qwen2's attention (q/k/v bias); every layer sparse (llama.cpp's qwen2moe has no dense layers);
    a shared expert of ``expert_shared_feed_forward_length``; the k weights not renormalised unless
    ``expert_weights_norm`` (llama.cpp's qwen2moe graph does not)."""
    from transformers import Qwen2MoeConfig

    meta = _Meta(gguf)
    common = meta.decoder_common()
    _check_full_rotary(meta, common["hidden_size"] // common["num_attention_heads"])
    return Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], rope_parameters=meta.rope_parameters(),
                          num_experts=int(meta.need("expert_count")),
                          num_experts_per_tok=int(meta.need("expert_used_count")),
                          moe_intermediate_size=int(meta.need("expert_feed_forward_length")),
                          shared_expert_intermediate_size=int(meta.need("expert_shared_feed_forward_length")),
                          norm_topk_prob=bool(meta.get("expert_weights_norm", False)), mlp_only_layers=[],
                          decoder_sparse_step=1, **common)


_MOE_LAYER_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}

# GGUF ``general.architecture`` -> mapping (llama and gemma3 have their own modules).
GGUF_ARCHS: dict[str, GGUFArch] = {
    "qwen2": GGUFArch("Qwen2ForCausalLM", _qwen2_config, LLAMA_LIKE_LAYER_NAMES, LLAMA_LIKE_GLOBAL_NAMES),
    "qwen3": GGUFArch("Qwen3ForCausalLM", _qwen3_config, LLAMA_LIKE_LAYER_NAMES, LLAMA_LIKE_GLOBAL_NAMES),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", _qwen3moe_config, {**LLAMA_LIKE_LAYER_NAMES, **_MOE_LAYER_NAMES},
                         LLAMA_LIKE_GLOBAL_NAMES, per_expert=("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                         float_parts=("ffn_gate_inp",)),
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", _qwen2moe_config,
                         {**LLAMA_LIKE_LAYER_NAMES, **_MOE_LAYER_NAMES, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                          "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                          "ffn_down_shexp": "mlp.shared_expert.down_proj"},
                         LLAMA_LIKE_GLOBAL_NAMES, per_expert=("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                         float_parts=("ffn_gate_inp", "ffn_gate_inp_shexp")),
    "phi3": GGUFArch(
        "Phi3ForCausalLM", _phi3_config,
        {**LLAMA_LIKE_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        LLAMA_LIKE_GLOBAL_NAMES, skip=("rope_factors_short.weight", "rope_factors_long.weight"),
        fused={"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}),
    "gpt2": GGUFArch(
        "GPT2LMHeadModel", _gpt2_config,
        {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
         "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
        {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
         "output": "lm_head"},
        layer_prefix="transformer.h", transposed=(".attn.c_attn.", ".attn.c_proj.", ".mlp.c_fc.", ".mlp.c_proj."),
        fused={"attn_qkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj")}),
}


def _row_blocks(hf_config: Any, count: int) -> tuple[int, ...]:
    """Row counts of a fused matrix's blocks: q/k/v (``count`` 3) or gate/up (2, equal halves)."""
    if count == 2:
        return (int(hf_config.intermediate_size),) * 2
    heads = int(getattr(hf_config, "num_attention_heads", None) or hf_config.n_head)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    hidden = int(getattr(hf_config, "hidden_size", None) or hf_config.n_embd)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def iter_gguf_arch_weights(gguf: GGUFFile, arch: GGUFArch, hf_config: Any,
                           keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every tensor of the file, rows as stored (no q/k un-permutation: see above).

    ``keep_quantized``: quantized matrices other than the embeddings come as raw blocks (``GGUFQuantTensor``,
    fused ones split into their row blocks) for the ``gguf`` quantization.
    """
    for name in gguf.tensors:
        if name in arch.skip:
            continue
        hf = arch.hf_name(name)
        block = block_part(name)
        if block and block[1] in arch.per_expert:
            yield from iter_expert_tensors(gguf, name, hf, keep_quantized)
            continue
        if keep_quantized and not name.startswith(("token_embd.", "position_embd.")) \
                and not (block and block[1] in arch.float_parts):
            raw = gguf.load_raw(name)
            if raw is not None:
                parts = arch.fused.get(block[1]) if block else None
                if not parts:
                    yield hf, raw
                    continue
                start = 0
                for part, rows in zip(parts, _row_blocks(hf_config, len(parts)), strict=True):
                    rows_raw = dataclasses.replace(raw, raw=raw.raw[start:start + rows], shape=(rows, raw.shape[1]))
                    yield f"{arch.layer_prefix}.{block[0]}.{part}.weight", rows_raw
                    start += rows
                continue
        array = gguf.load(name)
        if not array.flags.writeable:
            array = np.array(array, dtype=np.float32)  # F32/F16 tensors are views of the read-only map
        tensor = torch.from_numpy(array)
        transposed = hf.endswith(".weight") and any(t in hf for t in arch.transposed)
        yield hf, (tensor.t() if transposed else tensor)
