"""What a request asks its output to follow (vLLM's ``StructuredOutputsParams`` names). No torch here."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarKey:
    """Hashable identity of a grammar: its kind and a canonical text of its spec (the compile-cache key)."""

    kind: str  # "json" | "regex" | "choice" | "grammar" | "json_object"
    spec: str


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields must be set.

    ``json``: a JSON schema (dict or JSON text); ``regex``: the whole output fullmatches it; ``choice``: the
    output is exactly one of these strings; ``grammar``: an EBNF grammar (xgrammar/GBNF dialect with a
    ``root`` rule); ``json_object=True``: any JSON object.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_fields) != 1:
            given = ", ".join(set_fields) if set_fields else "none"
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be set (got {given})")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json: must be a JSON schema object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex: must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar: must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice: every choice must be a non-empty string")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object: must be true when given")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def key(self) -> GrammarKey:
        kind = self.kind
        if kind == "json":
            spec = json.dumps(self.json, separators=(",", ":"))  # key order matters: it orders the output
        elif kind == "choice":
            spec = json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return GrammarKey(kind, spec)

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        """From the API's ``structured_outputs`` object; unknown keys are an error that names them."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError("structured_outputs: must be an object")
        unknown = sorted(set(data) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: is not supported (supported: {', '.join(KINDS)})")
        return cls(**{k: v for k, v in data.items() if v is not None})
