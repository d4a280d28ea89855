"""Per-request parameters of a pooling (embedding) request, with vLLM's names. No torch here.

The pooling method itself (mean / cls / last) belongs to the model (``PoolerConfig``); a request can only
choose whether to normalise, how many Matryoshka dimensions to keep, and to truncate its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PoolingParams:
    """``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: the model's maximum length).
    ``normalize``: None uses the model's setting. ``dimensions``: keep the first d values (Matryoshka)."""

    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    n = 1  # one output per request, as for SamplingParams(n=1)

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens: must be a positive integer or -1, got {t!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions: must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be a boolean, got {self.normalize!r}")
