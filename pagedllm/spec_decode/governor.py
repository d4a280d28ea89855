"""``DraftGovernor``: whether drafting pays on this machine, measured as the engine runs.

Speculation trades extra work per step (the drafter's run, k more query tokens to verify) for more tokens per
step. Which side wins depends on the CPU, the model, the method, the batch size and the prompts (n-gram lookup on
grounded text accepts often; a layer-skip drafter on a small model can cost more than it saves:
docs/performance.md), so no static rule holds on every machine. The governor compares, per batch-size bucket,
the tokens per second of decode steps that verified drafts against steps that did not, and stops drafting in a
bucket where drafting is more than ``max_loss`` slower. Every ``probe_every`` steps it leaves one step without
drafts, so both rates stay current; after ``cooldown_steps`` with drafting off in a bucket it tries again, since
the workload may have changed.

Only pure decode steps are measured (every request yields tokens, none computes prompt tokens): a step that
also prefills says nothing about the cost of drafting. No torch here.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from pagedllm.logger import init_logger

logger = init_logger(__name__)

WINDOW = 16  # samples kept per bucket and kind: the median of these is the rate
MIN_DRAFTED_SAMPLES = 8
MIN_PLAIN_SAMPLES = 3


def bucket_of(num_requests: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 4, 8, ...): a step's cost grows with its batch."""
    return 1 << max(num_requests - 1, 0).bit_length()


@dataclass
class _Bucket:
    drafted: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # tokens / s, steps with drafts
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # tokens / s, steps without
    enabled: bool = True
    off_since: int = 0  # step count when drafting was turned off here


class DraftGovernor:
    """Decides per step whether to draft (``drafting``) from the steps it is told about (``observe``).

    ``max_loss``: drafting stops in a bucket where it is slower than not drafting by more than this fraction.
    ``enabled=False`` makes the governor always say yes (``auto_disable: false`` in the speculative config).
    """

    def __init__(self, enabled: bool = True, max_loss: float = 0.10, probe_every: int = 32,
                 cooldown_steps: int = 512) -> None:
        self.active = enabled
        self.max_loss = max_loss
        self.probe_every = probe_every
        self.cooldown_steps = cooldown_steps
        self.buckets: dict[int, _Bucket] = {}
        self.steps = 0
        self.num_turned_off = 0  # cumulative, for the metric

    def _bucket(self, num_requests: int) -> _Bucket:
        return self.buckets.setdefault(bucket_of(num_requests), _Bucket())

    def drafting(self, num_requests: int) -> bool:
        """Whether to propose drafts for a step of about ``num_requests`` requests."""
        if not self.active:
            return True
        bucket = self._bucket(num_requests)
        if not bucket.enabled:
            if self.steps - bucket.off_since < self.cooldown_steps:
                return False
            bucket.enabled = True  # try again: the workload may have changed
            bucket.drafted.clear()
            logger.info("speculative decoding: drafting again at batch size ~%d after %d steps off",
                        bucket_of(num_requests), self.cooldown_steps)
        # A step without drafts now and then keeps the plain rate measured while drafting is on.
        return self.steps % self.probe_every != self.probe_every - 1

    def observe(self, num_requests: int, num_tokens: int, seconds: float, drafted: bool) -> None:
        """A pure decode step: ``num_tokens`` new tokens for ``num_requests`` requests in ``seconds`` (for a
        step that verified drafts, including the time spent proposing them)."""
        self.steps += 1
        if not self.active or seconds <= 0 or num_tokens <= 0:
            return
        bucket = self._bucket(num_requests)
        (bucket.drafted if drafted else bucket.plain).append(num_tokens / seconds)
        if not bucket.enabled or len(bucket.drafted) < MIN_DRAFTED_SAMPLES or len(bucket.plain) < MIN_PLAIN_SAMPLES:
            return
        with_drafts, without = statistics.median(bucket.drafted), statistics.median(bucket.plain)
        if with_drafts < (1.0 - self.max_loss) * without:
            bucket.enabled = False
            bucket.off_since = self.steps
            self.num_turned_off += 1
            logger.warning("speculative decoding: drafting off at batch size ~%d: %.1f tok/s with drafts vs "
                           "%.1f without (retried after %d steps)", bucket_of(num_requests), with_drafts, without,
                           self.cooldown_steps)
