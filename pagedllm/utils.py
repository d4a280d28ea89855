"""Small helpers shared across rooms: sizes, ids, cdiv."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "t": 1000**4, "tb": 1000**4}


def parse_size(value: str | int | float) -> int:
    """Parse a memory size such as ``4GiB``, ``512MiB``, ``2g`` or a byte count into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse memory size {value!r} (examples: 4GiB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


def random_uuid() -> str:
    return uuid.uuid4().hex


def parse_json_object(raw: str | dict, field: str, known_keys: set[str] | frozenset[str]) -> dict:
    """A JSON-object flag (``--speculative-config``, ``--kv-events-config``: a JSON string or a dict) → its dict.

    ValueError naming ``field`` for bad JSON, a non-object, or keys outside ``known_keys``.
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(known_keys))
    if unknown:
        raise ValueError(f"{field}: unknown key(s) {unknown}; known: {sorted(known_keys)}")
    return raw


def physical_cpu_cores() -> int:
    """Physical cores of this host (logical ones if psutil cannot tell): the CPU engines' thread budget."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def cache_dir() -> Path:
    """Where pagedllm keeps what it made or measured on this machine (joined model parts, the kernel autotune
    table): ``PAGEDLLM_CACHE_DIR``, default ``$XDG_CACHE_HOME/pagedllm`` or ``~/.cache/pagedllm``."""
    from pagedllm import envs

    if envs.PAGEDLLM_CACHE_DIR:
        return Path(envs.PAGEDLLM_CACHE_DIR).expanduser()
    base = envs.XDG_CACHE_HOME
    return (Path(base) if base else Path.home() / ".cache") / "pagedllm"


def freeze_gc_heap() -> int:
    """Collect once, then move every object alive now (the model's modules, torch's and the libraries' state) out
    of the cyclic collector's reach: its full collections otherwise walk them all again and again while the engine
    serves (a measurable share of a concurrent Whisper run: docs/performance.md). Only for a process that holds one
    engine for its whole life (an engine core process, the API server): frozen objects are never collected, so an
    offline ``LLM`` that a program builds and drops repeatedly must not freeze (``gc_heap_frozen`` gives them back
    after). Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[None]:
    """``freeze_gc_heap`` for a stretch of work (a bench's timed runs inside a process that goes on), then the
    frozen objects handed back to the collector, so that an engine dropped later is still freed."""
    freeze_gc_heap()
    try:
        yield
    finally:
        gc.unfreeze()
