"""Chained block hashes of the prefix cache: the one place that decides how a block's hash is computed.

A full block's hash covers its parent's hash value, its token ids and its extra keys (the cache salt, first
block only, then whatever the request's ``block_keys`` hook adds for the block: a LoRA adapter's content digest on
the first block, the content hash and offset of each image with tokens in it, ``core/multimodal.py``), so equal
values mean equal prefixes (hits are still verified against the stored tokens and keys).

Two algorithms (``--prefix-caching-hash-algo``, vLLM's flag):

- ``builtin``: Python's ``hash()`` of a tuple. Fast, but a salted ``str`` hash makes values differ between
  processes, so only the process that computed them can use them.
- ``sha256``: sha256 of a fixed byte encoding, truncated to 8 bytes. The same seed, tokens and salt give the
  same values in every process and on every machine, so a router in another process can predict which
  engine holds a prompt's blocks (``compute_block_hash_values``).

The chain starts at a root value (``root_hash_value``): random per process without a seed, derived from
``--prefix-caching-hash-seed`` with one.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HASH_ALGOS = ("builtin", "sha256")
# A request's per-block extra keys: (first position, end position) of a full block -> keys (str / bytes / int)
# that must match for two blocks to be the same, beyond their tokens (images; an adapter's digest).
BlockKeysFn = Callable[[int, int], tuple]
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockHash:
    """Identity of a full block: chained hash plus the exact tokens (so a hit can be verified).

    ``value`` hashes the parent's value, this block's token ids and its extra keys (e.g. a cache salt).
    """

    value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()


def check_hash_algo(algo: str) -> str:
    """``algo`` if it is a known hash algorithm, else a ValueError naming the setting."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo: unknown algorithm {algo!r}; choose one of {list(HASH_ALGOS)}")
    return algo


def root_hash_value(seed: int | None, algo: str) -> int:
    """The parent value of a prompt's first block.

    No seed: random per process (hashes can't be predicted from outside). With a seed: ``builtin`` keeps its
    per-process ``hash()`` of a tuple with a string (stable only within one process); ``sha256`` gives the
    same value in every process.
    """
    check_hash_algo(algo)
    if seed is None:
        return random.getrandbits(63)
    if algo == "builtin":
        return hash(("pagedllm", seed))
    return _digest64(b"pagedllm-root:" + str(seed).encode())


def block_extra_keys(block_index: int, cache_salt: str | None, block_size: int = 0,
                     block_keys: BlockKeysFn | None = None) -> tuple:
    """Extra keys of block ``block_index``: only the first carries the salt (later blocks inherit it through
    the chain); then ``block_keys`` of the block's positions, when the request has such a hook."""
    keys = (cache_salt,) if cache_salt and block_index == 0 else ()
    if block_keys is not None:
        keys += block_keys(block_index * block_size, (block_index + 1) * block_size)
    return keys


def block_hash_value(parent_value: int, token_ids: tuple[int, ...], extra_keys: tuple, algo: str) -> int:
    """The hash value of one full block."""
    if algo == "builtin":
        return hash((parent_value, token_ids, extra_keys))
    if algo != "sha256":
        check_hash_algo(algo)
    # Parent (8 bytes, two's complement so builtin-range values encode too), the token count, the token ids
    # (uint32), then the extra keys: fixed widths and counts, so two different blocks never share an encoding.
    n = len(token_ids)
    data = (parent_value & _MASK64).to_bytes(8, "little") + struct.pack(f"<I{n}I", n, *token_ids)
    return _digest64(data + _encode_extra_keys(extra_keys))


def hash_block(parent_value: int, token_ids: tuple[int, ...], extra_keys: tuple = (),
               algo: str = "builtin") -> BlockHash:
    """The ``BlockHash`` of one full block (its value and what a hit must match)."""
    return BlockHash(block_hash_value(parent_value, token_ids, extra_keys, algo), token_ids, extra_keys)


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        root_value: int, algo: str, cache_salt: str | None,
                        block_keys: BlockKeysFn | None = None) -> None:
    """Append the hash of every full block of ``token_ids`` past the ``len(block_hashes)`` already there.

    Incremental, so the KV cache manager hashes each block of a growing request once.
    """
    while (len(block_hashes) + 1) * block_size <= len(token_ids):
        i = len(block_hashes)
        parent = root_value if i == 0 else block_hashes[i - 1].value
        block_hashes.append(hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]),
                                       block_extra_keys(i, cache_salt, block_size, block_keys), algo))


def compute_block_hash_values(token_ids: list[int], block_size: int, root_value: int, algo: str,
                              cache_salt: str | None, block_keys: BlockKeysFn | None = None) -> list[int]:
    """The chained hash values of a prompt's full blocks, exactly as the KV cache manager computes them.

    A router reproduces an engine's values with the engine's root (``root_hash_value(seed, "sha256")``).
    """
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, root_value, algo, cache_salt, block_keys)
    return [h.value for h in hashes]


def _digest64(data: bytes) -> int:
    # 8 bytes keep the value an int like builtin's (msgpack, sets); hits are verified against tokens anyway.
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def _encode_extra_keys(keys: tuple) -> bytes:
    out = [struct.pack("<I", len(keys))]
    for key in keys:
        if isinstance(key, str):
            raw = key.encode()
            out.append(b"s" + struct.pack("<I", len(raw)) + raw)
        elif isinstance(key, bytes):
            out.append(b"b" + struct.pack("<I", len(key)) + key)
        elif isinstance(key, int) and not isinstance(key, bool):
            out.append(b"i" + (key & _MASK64).to_bytes(8, "little"))
        else:
            raise TypeError(f"block hash extra key of type {type(key).__name__} has no stable encoding")
    return b"".join(out)
