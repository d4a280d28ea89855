"""The key rotation of fp8 KV caches (attention/key_rotation.py, the C++ ``hadamard_heads_``): orthogonal, exact
in every float dtype, the same through the C++ kernel and torch, and what it is for: less rounding error in the
scores of an e4m3 cache."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backends.paged_kv import dequantize_kv, quantize_kv
from pagedllm.attention.key_rotation import KeyRotation, hadamard_block_size, rotate_heads_
from pagedllm.kernels.cpu import load_cpu_kernels

HEAD_SIZES = (64, 80, 96, 128, 256)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_query_and_key_matrices_keep_every_score_exactly(head_size: int) -> None:
    rot = KeyRotation.for_head_size(head_size)
    assert rot.block == hadamard_block_size(head_size) and head_size % rot.block == 0
    q, k = (rot.matrix(w, torch.float64, "cpu") for w in ("query", "key"))
    assert torch.equal(q @ k.T, torch.eye(head_size, dtype=torch.float64))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):  # entries are powers of two: exact everywhere
        assert torch.equal(rot.matrix("key", dtype, "cpu").double(), k)
        assert torch.equal(rot.matrix("query", dtype, "cpu").double(), q)


def test_block_sizes() -> None:
    assert [hadamard_block_size(d) for d in (64, 80, 96, 112, 128, 72)] == [64, 16, 32, 16, 128, 8]
    with pytest.raises(ValueError, match="head_size"):
        hadamard_block_size(0)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kernel_equals_torch_on_strided_heads(head_size: int, dtype: torch.dtype) -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels are not built here")
    rot = KeyRotation.for_head_size(head_size)
    torch.manual_seed(head_size)
    qkv = torch.randn(9, 6 * head_size + 3, dtype=dtype) * 4
    before = qkv.clone()
    x = qkv[:, 3:3 + 4 * head_size].view(9, 4, head_size)[:, 1:]  # rows and heads strided, 3 heads each
    want = x.clone()
    rotate_heads_(want, rot, "key")
    kernels.hadamard_heads_(x, rot.block, rot.key_scale)
    tol = 2e-6 if dtype == torch.float32 else 2 ** -8  # bf16: one rounding either way
    torch.testing.assert_close(x.float(), want.float(), rtol=tol, atol=tol * 4)
    touched = torch.zeros_like(qkv, dtype=torch.bool)
    touched[:, 3 + head_size:3 + 4 * head_size] = True
    assert torch.equal(qkv[~touched], before[~touched])  # the other heads and columns as they were


def test_the_kernel_refuses_bad_shapes() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels are not built here")
    with pytest.raises(RuntimeError, match="power of two"):
        kernels.hadamard_heads_(torch.zeros(2, 1, 80), 32, 1.0)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        kernels.hadamard_heads_(torch.zeros(2, 64, 3).transpose(1, 2), 64, 1.0)


def test_rotated_keys_round_to_smaller_score_errors_in_e4m3() -> None:
    """Keys with a few large channels (as RoPE's slow pairs give): scores over e4m3-rounded keys err less when the
    keys were rotated first (the reason for the rotation). Measured on these tensors: 0.84 against 2.06."""
    torch.manual_seed(0)
    d = 64
    keys = torch.randn(512, 1, d)
    keys[..., :4] *= 12  # outlier channels
    queries = torch.randn(64, 1, d)
    queries[..., :4] *= 3
    exact = queries[:, 0] @ keys[:, 0].T
    rot = KeyRotation.for_head_size(d)

    def rounded(k: torch.Tensor) -> torch.Tensor:
        return dequantize_kv(quantize_kv(k, torch.float8_e4m3fn, None), torch.float32, None)

    plain = queries[:, 0] @ rounded(keys)[:, 0].T
    rq, rk = queries.clone(), keys.clone()
    rotate_heads_(rq, rot, "query")
    rotate_heads_(rk, rot, "key")
    turned = rq[:, 0] @ rounded(rk)[:, 0].T
    plain_err, turned_err = (plain - exact).pow(2).mean().sqrt(), (turned - exact).pow(2).mean().sqrt()
    assert turned_err < plain_err / 2, (plain_err, turned_err)


@pytest.mark.parametrize("backend_name", ["cpu", "torch"])
def test_an_fp8_layer_stores_rotated_keys_and_attends_closer_to_the_unrounded(backend_name: str) -> None:
    """The Attention layer over an fp8 cache (bound by ``bind_kv_caches``, scales 1.0): the cache holds
    e4m3(K @ R_key), and a prompt's output is closer to attention over the unrounded K/V than the same layer's with
    the rotation off, on keys with a few large channels (measured: 0.052 against 0.088 root-mean-square). A layer
    whose scales are the checkpoint's keeps keys as they are."""
    from pagedllm.attention.backends.cpu_paged import CpuPagedAttentionBackend
    from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
    from pagedllm.attention.forward_context import forward_context
    from pagedllm.attention.metadata import build_attention_metadata
    from pagedllm.model_executor.layers.attention import Attention, bind_kv_caches

    from helpers.step_state import prepared

    if backend_name == "cpu" and load_cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels are not built here")
    backend = CpuPagedAttentionBackend() if backend_name == "cpu" else TorchPagedAttentionBackend()
    heads, kv_heads, d, tokens, block = 4, 2, 64, 40, 16
    torch.manual_seed(1)
    q, k, v = torch.randn(tokens, heads, d), torch.randn(tokens, kv_heads, d) * 2, torch.randn(tokens, kv_heads, d)
    q[..., :4] *= 4
    k[..., :4] *= 10

    def run(rotate: bool, from_checkpoint: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        layer = Attention(heads, d, d ** -0.5, kv_heads, backend=backend)
        layer.kv_scales_from_checkpoint = from_checkpoint
        cache = torch.zeros(2, 4, block, kv_heads, d, dtype=torch.float8_e4m3fn)
        bind_kv_caches(layer, [cache])
        assert (layer.key_rotation is not None) == (not from_checkpoint)
        if not rotate:
            layer.key_rotation = None
        meta = prepared(build_attention_metadata([tokens], [tokens], [[0, 1, 2]], block), kernels=load_cpu_kernels()
                        if backend_name == "cpu" else None)
        with forward_context(meta):
            out = layer(q.reshape(tokens, -1).clone(), k.reshape(tokens, -1).clone(), v.reshape(tokens, -1).clone())
        return out.view(tokens, heads, d), cache

    exact = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    turned, cache = run(rotate=True)
    rotated = k.clone()
    rotate_heads_(rotated, KeyRotation.for_head_size(d), "key")
    stored = cache[0].view(-1, kv_heads, d)[:tokens]
    assert torch.equal(stored.view(torch.uint8), quantize_kv(rotated, torch.float8_e4m3fn, None).view(torch.uint8))
    plain, plain_cache = run(rotate=False)
    assert torch.equal(plain_cache[0].view(-1, kv_heads, d)[:tokens].view(torch.uint8),
                       quantize_kv(k, torch.float8_e4m3fn, None).view(torch.uint8))
    turned_err, plain_err = ((o - exact).pow(2).mean().sqrt() for o in (turned, plain))
    assert turned_err < plain_err * 0.7, (turned_err, plain_err)
    run(rotate=True, from_checkpoint=True)  # asserts the layer has no rotation
