"""--kv-cache-prefault: the CPU KV cache's pages written at start-up (resident before the first request, no page
fault inside a step), or, with --no-kv-cache-prefault, mapped as blocks are first used."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine_args import EngineArgs
from pagedllm.platforms.cpu_memory import zeroed_host_tensor

from helpers.model_helpers import default_model_path, make_tiny_llama


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s pages that are resident, by mincore(2) (adjacent anonymous mappings merge in smaps)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * -(-length // page))()
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


def test_a_prefaulted_tensor_is_resident_and_zero() -> None:
    shape = (2, 128, 16, 4, 64)  # 4 MiB of float32
    nbytes = 4 << 20
    lazy = zeroed_host_tensor(shape, torch.float32)
    assert _resident_bytes(lazy) < nbytes // 8  # nothing written yet
    eager = zeroed_host_tensor(shape, torch.float32, prefault=True)
    assert _resident_bytes(eager) >= nbytes
    assert eager.shape == shape and not eager.any()


def test_the_flag_reaches_the_cache_config(tmp_path, monkeypatch) -> None:
    model = make_tiny_llama(tmp_path / "m")
    monkeypatch.delenv("PAGEDLLM_KV_CACHE_PREFAULT", raising=False)  # tests/conftest.py sets it to 0
    assert EngineArgs(model=model).create_engine_config().cache.kv_cache_prefault
    assert EngineArgs(model=model, kv_cache_prefault=True).create_engine_config().cache.kv_cache_prefault
    monkeypatch.setenv("PAGEDLLM_KV_CACHE_PREFAULT", "0")
    assert not EngineArgs(model=model).create_engine_config().cache.kv_cache_prefault
    assert not EngineArgs(model=model, kv_cache_prefault=False).create_engine_config().cache.kv_cache_prefault
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--no-kv-cache-prefault"]).kv_cache_prefault is False
    assert parser.parse_args([]).kv_cache_prefault is None  # the environment's default then


def test_an_engine_holds_its_kv_cache_from_start_up_and_generates_the_same(tmp_path) -> None:
    from transformers import AutoTokenizer

    model = make_tiny_llama(tmp_path / "m")
    gguf = default_model_path()  # the engine needs a tokenizer to detokenize; any will do for ids < 256
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 7]}, {"prompt_token_ids": [11, 2]}]
    outputs = {}
    for prefault in (True, False):
        llm = LLM(model=model, kv_cache_memory="16MiB", kv_cache_prefault=prefault, max_model_len=128)
        caches = llm.engine.core.worker.runner.kv_caches
        nbytes = caches[0].numel() * caches[0].element_size()
        resident = _resident_bytes(caches[0])
        assert (resident >= nbytes) if prefault else (resident < nbytes // 2), (prefault, resident, nbytes)
        outputs[prefault] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm
    assert outputs[True] == outputs[False]
