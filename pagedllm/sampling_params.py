"""Per-request sampling parameters, with vLLM's names, defaults and meaning, and the structured-output
constraint a request may carry (``StructuredOutputsParams``: plain data, compiled by ``structured_output/``).

Validation happens once, when the object is built, so the sampler can trust every value it sees.
Each error names the offending field so an API layer can pass the message straight to the client.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

# Below this temperature a request is treated as greedy (dividing logits by ~0 is meaningless).
SAMPLING_EPS = 1e-5
# Largest number of top logprobs a request may ask for (OpenAI's limit too).
MAX_LOGPROBS = 20
# logit_bias values live in [-100, 100], as in the OpenAI API.
MAX_LOGIT_BIAS = 100.0


# The structured-output kinds a request may ask for (structured_output/ compiles them).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


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
            kinds = ", ".join(STRUCTURED_OUTPUT_KINDS)
            raise ValueError(f"structured_outputs: exactly one of {kinds} must be set (got {given})")
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
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))

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
        unknown = sorted(set(data) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: is not supported "
                             f"(supported: {', '.join(STRUCTURED_OUTPUT_KINDS)})")
        return cls(**{k: v for k, v in data.items() if v is not None})


@dataclass
class ReasoningParams:
    """Where a reasoning model's thinking ends, so constraints wait for the answer and a budget can end it.

    ``end_token_ids``: the token ids of the end marker (``</think>``). ``start_token_ids``: None when the
    output is reasoning from its first token (the prompt opened it, as DeepSeek-R1's template does); else the
    output reasons only if it starts with these ids. ``thinking_token_budget``: after this many reasoning
    tokens the end marker is forced and the answer follows (vLLM's name); None = no limit.
    """

    end_token_ids: list[int]
    start_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        self.end_token_ids = list(self.end_token_ids)
        if not self.end_token_ids:
            raise ValueError("reasoning: end_token_ids must not be empty")
        if self.start_token_ids is not None:
            self.start_token_ids = list(self.start_token_ids)
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise ValueError(f"thinking_token_budget must be a non-negative integer, got {budget!r}")


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `seed=True` is almost certainly a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request (vLLM-compatible).

    ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` means "up to the context length".
    ``logprobs=k`` returns, for every output token, the sampled token's logprob plus the top ``k``.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = field(default=None)
    # Constrain the output to a JSON schema / regex / choice / grammar (a dict is converted).
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's think markers: structured outputs apply after them, a budget may end them early.
    reasoning: ReasoningParams | None = None
    # Not sampling: data for other parts of the engine (vLLM's name); "kv_transfer_params" for a KV connector
    # (distributed/kv_transfer/).
    extra_args: dict | None = None
    # Only these tokens can be sampled (vLLM's name). On a Whisper model such a row also skips Whisper's own
    # decoding rules: the caller said exactly what may come next (language detection, sample/whisper_rules.py).
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # Normalize containers first so validation sees one shape.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._verify()
        if self.sampling_type == SamplingType.GREEDY:
            # Greedy ignores the truncation knobs; resetting them keeps the sampler's fast paths on.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _normalize_logit_bias(bias: dict) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            # JSON object keys are always strings, so "50256" must become 50256.
            try:
                token_id = int(key) if not isinstance(key, bool) else None
            except (TypeError, ValueError):
                token_id = None
            if token_id is None or (isinstance(key, float) and not key.is_integer()):
                raise ValueError(f"logit_bias keys must be integer token ids, got {key!r}")
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id}")
            try:
                bias_value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias values must be numbers, got {value!r}") from None
            if math.isnan(bias_value):
                raise ValueError(f"logit_bias value for token {token_id} must be a number, got nan")
            out[token_id] = min(max(bias_value, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
        return out

    def _verify(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0 or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value}")
            if value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain non-negative integers, got {t!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    raise ValueError(f"allowed_token_ids must contain non-negative integers, got {t!r}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def verify_token_ids(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce (the front end knows the vocab; this object does not)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: token id {t} is out of range for vocab size {vocab_size}")
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ValueError(f"logit_bias: token id {t} is out of range for vocab size {vocab_size}")
        for t in self.allowed_token_ids or ():
            if t >= vocab_size:
                raise ValueError(f"allowed_token_ids: token id {t} is out of range for vocab size {vocab_size}")

    def clone(self) -> SamplingParams:
        """Deep copy (the lists and dict are per-request and may be mutated downstream)."""
        return copy.deepcopy(self)

    def child_params(self, index: int) -> SamplingParams:
        """Params for the ``index``-th of the ``n`` sequences of a request (n > 1 fan-out).

        Each child samples one sequence. A seeded request gives child ``i`` the seed ``seed + i`` so the
        children differ from each other yet the whole request stays reproducible.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"index must be in [0, n={self.n}), got {index}")
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child
