"""``--lora-modules``: adapters a server starts with, in vLLM's two forms.

``name=path`` or a JSON object ``{"name": ..., "path": ..., "base_model_name": ...}`` per value.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def parse_lora_modules(values: Iterable[Any] | None) -> tuple[tuple[str, str, str | None], ...]:
    """(name, path, base_model_name or None) of each value; ValueError naming the bad value."""
    modules = []
    for value in values or ():
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {value!r} is not valid JSON ({e})") from None
        if isinstance(value, dict):
            unknown = set(value) - {"name", "path", "base_model_name"}
            if unknown or not value.get("name") or not value.get("path"):
                raise ValueError(f"lora_modules: {value!r} needs 'name' and 'path' (and optionally "
                                 "'base_model_name'), nothing else")
            modules.append((str(value["name"]), str(value["path"]), value.get("base_model_name")))
        elif isinstance(value, str) and "=" in value:
            name, _, path = value.partition("=")
            if not name or not path:
                raise ValueError(f"lora_modules: {value!r} must be name=path")
            modules.append((name, path, None))
        else:
            raise ValueError(f"lora_modules: {value!r} must be name=path or a JSON object with name and path")
    names = [m[0] for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: adapter names must be unique, got {names}")
    return tuple(modules)
