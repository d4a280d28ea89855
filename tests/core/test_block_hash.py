"""Block hashes: sha256 gives the same values in every process; the router's function equals the manager's."""

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_hash import compute_block_hash_values, root_hash_value
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler

from helpers.fake_runner import reference_output
from helpers.scheduler import make_request, run_to_completion

REPO = Path(__file__).resolve().parents[2]
BS = 4

_CHILD = """
import json
from pagedllm.core.block_hash import compute_block_hash_values, root_hash_value
root = root_hash_value(1234, {algo!r})
print(json.dumps([root, compute_block_hash_values(list(range(37)), 4, root, {algo!r}, "tenant-a")]))
"""


def _hash_in_subprocess(algo: str, python_hash_seed: str) -> list:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": python_hash_seed}
    out = subprocess.run([sys.executable, "-c", _CHILD.format(algo=algo)], env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def test_sha256_values_agree_across_processes():
    first, second = _hash_in_subprocess("sha256", "1"), _hash_in_subprocess("sha256", "2")
    assert first == second and len(first[1]) == 9
    # builtin hashes a str, which Python salts per process: the reason sha256 exists.
    assert _hash_in_subprocess("builtin", "1") != _hash_in_subprocess("builtin", "2")


def test_sha256_values_are_pinned():
    # Engines and routers of different builds must agree: changing the encoding is a breaking change.
    root = root_hash_value(0, "sha256")
    assert root == 0xCA9557896BF740D9
    assert compute_block_hash_values([1, 2, 3, 4, 5, 6, 7, 8], 4, root, "sha256", None) == [
        0xB46C03B5898D128D, 0xBDEE4938890290D9]
    # The documented encoding (docs/data_parallel.md): parent as 8 bytes little-endian, then uint32 little-endian
    # token count, token ids and extra-key count; the value is the digest's first 8 bytes, big-endian.
    data = root.to_bytes(8, "little") + struct.pack("<6I", 4, 1, 2, 3, 4, 0)
    assert int.from_bytes(hashlib.sha256(data).digest()[:8], "big") == 0xB46C03B5898D128D


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_compute_block_hash_values_equals_the_managers(algo, salt):
    kv = KVCacheManager(64, BS, hash_seed=7, hash_algo=algo)
    prompt = [(i * 31) % 100 for i in range(23)]  # 5 full blocks and a partial one
    req = make_request("r", prompt, max_tokens=4, salt=salt)
    hits, num_hit = kv.get_computed_blocks(req)
    kv.allocate_slots(req, len(prompt) - num_hit, hits, num_hit)
    expected = compute_block_hash_values(prompt, BS, kv.root_hash, algo, salt)
    assert [h.value for h in req.block_hashes] == expected and len(expected) == 5


def test_salt_and_seed_change_every_value():
    prompt = list(range(16))
    base = compute_block_hash_values(prompt, BS, root_hash_value(1, "sha256"), "sha256", None)
    salted = compute_block_hash_values(prompt, BS, root_hash_value(1, "sha256"), "sha256", "s")
    reseeded = compute_block_hash_values(prompt, BS, root_hash_value(2, "sha256"), "sha256", None)
    assert not set(base) & set(salted) and not set(base) & set(reseeded)
    # A shared prefix shares its leading values: what a router matches on.
    longer = compute_block_hash_values(prompt + [99] * 8, BS, root_hash_value(1, "sha256"), "sha256", None)
    assert longer[:4] == base and len(longer) == 6


def test_no_seed_gives_a_random_root_and_unknown_algo_is_rejected():
    assert root_hash_value(None, "sha256") != root_hash_value(None, "sha256")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        root_hash_value(0, "md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(8, BS, hash_algo="md5")


def test_scheduler_with_sha256_hits_the_prefix_cache():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128),
                      CacheConfig(block_size=BS, num_blocks=64, prefix_caching_hash_seed=0,
                                  prefix_caching_hash_algo="sha256"))
    assert sched.kv.hash_algo == "sha256" and sched.kv.root_hash == root_hash_value(0, "sha256")
    prompt = list(range(20))
    outputs, _ = run_to_completion(sched, {0: [make_request("a", prompt, 4)], 10: [make_request("b", prompt, 4)]})
    assert outputs["a"] == outputs["b"] == reference_output(prompt, 4)
    assert sched.kv.prefix_cache_hits == 16  # b found a's 4 full blocks (the last token is always recomputed)
