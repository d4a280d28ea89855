"""``--speculative-config``: parse and check vLLM's keys into a ``SpeculativeConfig``. No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.utils import parse_json_object

METHODS = ("ngram", "suffix", "draft_model", "layer_skip")
_SUFFIX_KEYS = {"suffix_decoding_max_tree_depth": "max_tree_depth",
                "suffix_decoding_max_cached_requests": "max_cached_requests",
                "suffix_decoding_max_spec_factor": "max_spec_factor",
                "suffix_decoding_min_token_prob": "min_token_prob"}
# vLLM's keys that mean something here; anything else is refused so a typo is not silently ignored.
_KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
               "num_draft_layers", "disable_by_batch_size", "auto_disable", *_SUFFIX_KEYS}
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 5
# Above this many requests in a step, a CPU step is compute-bound: k extra query tokens per request cost
# about what they save, so drafting stops (JSON null: never stop). vLLM's key; its default is "never".
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SuffixSettings:
    """Suffix decoding's settings, vLLM's ``suffix_decoding_*`` keys: the trees' depth (pattern + draft), how
    many finished outputs the global tree keeps, drafts per step per matched token, and the path probability
    under which a draft stops."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1


@dataclass
class SpeculativeConfig:
    """How the engine drafts tokens for the target model to verify.

    ``method``: ``ngram`` (prompt lookup), ``suffix`` (suffix decoding over the request and recent outputs,
    ``suffix``'s settings; ``num_speculative_tokens`` defaults to the tree depth, as in vLLM), ``draft_model``
    (a second, smaller model with the same tokenizer, ``model``) or ``layer_skip`` (the target's first
    ``num_draft_layers`` layers + its head).
    ``disable_by_batch_size``: no drafts in a step with more than this many requests (None: always draft;
    default DEFAULT_DISABLE_BY_BATCH_SIZE when the key is absent).
    ``auto_disable``: measure as the engine runs and stop drafting at batch sizes where it costs more than it
    saves (``spec_decode/governor.py``); on by default, ``false`` always drafts (comparisons, tests).
    ``draft_model_config`` is the resolved ``ModelConfig`` of the draft model (filled by engine args).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    auto_disable: bool = True
    draft_model_config: Any = None
    suffix: SuffixSettings = SuffixSettings()

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens that the drafter writes (a model-based drafter writes the K/V
        of its own proposals; n-gram lookup writes none)."""
        return 0 if self.method in ("ngram", "suffix") else self.num_speculative_tokens


def _positive_int(cfg: dict[str, Any], key: str, minimum: int = 1) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"speculative_config.{key}: must be an integer >= {minimum}, got {value!r}")
    return value


def parse_speculative_config(raw: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON string or dict with vLLM's keys → SpeculativeConfig (None stays None).

    Raises ValueError naming the offending key. ``method`` may be left out when ``model`` is given
    (``draft_model``) or ``prompt_lookup_max``/``prompt_lookup_min`` are (``ngram``), as in vLLM.
    """
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    raw = parse_json_object(raw, "speculative_config", _KNOWN_KEYS)
    method = raw.get("method")
    if method is None:
        if raw.get("model"):
            method = "draft_model"
        elif "prompt_lookup_max" in raw or "prompt_lookup_min" in raw:
            method = "ngram"
        elif "num_draft_layers" in raw:
            method = "layer_skip"
        else:
            raise ValueError(f"speculative_config.method: missing; one of {list(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not supported; one of {list(METHODS)}")
    suffix = _suffix_settings(raw) if method == "suffix" else SuffixSettings()
    k = _positive_int(raw, "num_speculative_tokens")
    if k is None and method == "suffix":
        k = suffix.max_tree_depth
    if k is None:
        raise ValueError("speculative_config.num_speculative_tokens: required (tokens drafted per step)")
    disable = _positive_int(raw, "disable_by_batch_size") if "disable_by_batch_size" in raw \
        else DEFAULT_DISABLE_BY_BATCH_SIZE
    auto_disable = raw.get("auto_disable", True)
    if not isinstance(auto_disable, bool):
        raise ValueError(f"speculative_config.auto_disable: must be true or false, got {auto_disable!r}")
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, disable_by_batch_size=disable,
                            auto_disable=auto_disable, suffix=suffix)
    if method == "ngram":
        lo, hi = _positive_int(raw, "prompt_lookup_min"), _positive_int(raw, "prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        lo, hi = lo or hi, hi or lo  # vLLM: one given means both
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is larger than prompt_lookup_max {hi}")
        cfg.prompt_lookup_min, cfg.prompt_lookup_max = lo, hi
    elif method == "suffix":
        pass  # its settings were read above
    elif method == "draft_model":
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model: the draft model's path or name is required for "
                             "method 'draft_model'")
        cfg.model = model
    else:
        layers = _positive_int(raw, "num_draft_layers")
        if layers is None:
            raise ValueError("speculative_config.num_draft_layers: required for method 'layer_skip' "
                             "(how many of the target's first layers draft)")
        cfg.num_draft_layers = layers
    for key in ("model", "num_draft_layers", "prompt_lookup_min", "prompt_lookup_max"):
        if key in raw and raw[key] is not None and getattr(cfg, key) != raw[key]:
            raise ValueError(f"speculative_config.{key}: does not apply to method {method!r}")
    if method != "suffix":
        for key in _SUFFIX_KEYS:
            if key in raw:
                raise ValueError(f"speculative_config.{key}: applies to method 'suffix' only, not {method!r}")
    return cfg


def _suffix_settings(raw: dict[str, Any]) -> SuffixSettings:
    """vLLM's ``suffix_decoding_*`` keys, checked."""
    values: dict[str, Any] = {}
    depth = _positive_int(raw, "suffix_decoding_max_tree_depth", minimum=2)
    if depth is not None:
        values["max_tree_depth"] = depth
    cached = _positive_int(raw, "suffix_decoding_max_cached_requests", minimum=0)
    if cached is not None:
        values["max_cached_requests"] = cached
    for key, lo, hi in (("suffix_decoding_max_spec_factor", 0.0, None), ("suffix_decoding_min_token_prob", 0.0, 1.0)):
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < lo or (hi is not None and
                                                                                          value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"speculative_config.{key}: must be a number {bound}, got {value!r}")
        values[_SUFFIX_KEYS[key]] = float(value)
    return SuffixSettings(**values)
