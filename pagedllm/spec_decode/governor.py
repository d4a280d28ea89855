"""``DraftGovernor``: whether drafting pays on this machine, judged on evidence as the engine runs.

Speculation trades extra work per step (the proposer's run, k more query tokens to verify) for more tokens per
step. Which side wins depends on the CPU, the model, the method, the batch size and the text (n-gram lookup on
grounded text accepts often; a layer-skip drafter on a small model can cost more than it saves:
docs/performance.md), so no static rule holds on every machine. The governor compares, per batch-size bucket,
the throughput of decode steps that verified drafts against steps that did not, and stops drafting in a bucket
where drafting is more than ``max_loss`` slower.

What makes the judgement trustworthy:

- Drafted throughput is total tokens over total seconds across a long window of steps, never a median of per-step
  rates: acceptance is bimodal (a step accepts nothing or a whole run), and the median of such rates ignores the
  steps that win. Each step's seconds are clipped at ``OUTLIER_FACTOR`` times the window's median, so one step
  disturbed by the machine cannot sink the total.
- A judgement needs ``MIN_DRAFTED_STEPS`` drafted steps at batch size 1, enough to span the first tokens of an
  answer (before it starts to copy) and more than one request; plain throughput is the median of the steps left
  without drafts, one in ``probe_every`` (their rate is one token per request, so the median is fair). A step of
  n requests holds n requests' evidence, so a bucket of n judges after 1/n of those steps (at least 16) and probes
  n times as often (at least every 8th step): under load a losing drafter costs the whole batch, and must stop
  within an answer, not after it.
- Off is not forever: the first retry comes after ``cooldown_steps`` steps, each further loss in a row doubles
  the wait (up to ``max_cooldown_steps``), and a retry that pays resets it. A retry starts with a fresh drafted
  window, so the old evidence cannot turn it straight off again.

Only pure decode steps are measured (every request yields tokens, none computes prompt tokens): a step that
also prefills says nothing about the cost of drafting. ``decisions`` counts each turn on / off by bucket (the
metric). No torch here.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from pagedllm.logger import init_logger

logger = init_logger(__name__)

DRAFTED_WINDOW = 256  # drafted steps kept per bucket: (tokens, seconds)
PLAIN_WINDOW = 32  # plain steps kept per bucket: tokens / s
MIN_DRAFTED_STEPS = 64
MIN_PLAIN_STEPS = 4
OUTLIER_FACTOR = 3.0  # a drafted step slower than this many times the window's median counts as that median x3
JUDGE_EVERY = 8  # drafted steps between judgements (and after each plain step): a judgement sorts the window


def bucket_of(num_requests: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 4, 8, ...): a step's cost grows with its batch."""
    return 1 << max(num_requests - 1, 0).bit_length()


@dataclass
class _Bucket:
    drafted: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=DRAFTED_WINDOW))
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))  # tokens / s
    enabled: bool = True
    off_since: int = 0  # step count when drafting was turned off here
    cooldown: int = 0  # steps to wait before the next retry (0: never turned off yet)
    retrying: bool = False  # drafting was turned back on and has not been judged since
    unjudged: int = 0  # drafted steps since the last judgement

    def drafted_rate(self) -> float:
        """Tokens per second over the window, each step's seconds clipped at OUTLIER_FACTOR x the median."""
        limit = OUTLIER_FACTOR * statistics.median(s for _, s in self.drafted)
        return sum(t for t, _ in self.drafted) / sum(min(s, limit) for _, s in self.drafted)


class DraftGovernor:
    """Decides per step whether to draft (``drafting``) from the steps it is told about (``observe``).

    ``max_loss``: drafting stops in a bucket where it is slower than not drafting by more than this fraction.
    ``probe_every``: one step in this many runs without drafts while drafting is on (the plain rate's samples).
    ``cooldown_steps`` / ``max_cooldown_steps``: the first and the longest wait before drafting is tried again.
    ``enabled=False`` makes the governor always say yes (``auto_disable: false`` in the speculative config).
    """

    def __init__(self, enabled: bool = True, max_loss: float = 0.05, probe_every: int = 32,
                 cooldown_steps: int = 128, max_cooldown_steps: int = 2048) -> None:
        self.active = enabled
        self.max_loss = max_loss
        self.probe_every = probe_every
        self.cooldown_steps = cooldown_steps
        self.max_cooldown_steps = max_cooldown_steps
        self.buckets: dict[int, _Bucket] = {}
        self.steps = 0
        self.decisions: Counter[tuple[int, str]] = Counter()  # (bucket, "off" | "on") -> times, cumulative

    @property
    def num_turned_off(self) -> int:
        return sum(n for (_, what), n in self.decisions.items() if what == "off")

    def decision_counts(self) -> dict[str, int]:
        """``decisions`` as the engine's messages carry them: "<bucket>:<on|off>" -> times."""
        return {f"{size}:{what}": n for (size, what), n in self.decisions.items()}

    def _bucket(self, num_requests: int) -> _Bucket:
        return self.buckets.setdefault(bucket_of(num_requests), _Bucket())

    def _probe_interval(self, size: int) -> int:
        return max(self.probe_every // size, min(8, self.probe_every))

    @staticmethod
    def _min_drafted(size: int) -> int:
        return max(MIN_DRAFTED_STEPS // size, min(16, MIN_DRAFTED_STEPS))

    def drafting(self, num_requests: int) -> bool:
        """Whether to propose drafts for a step of about ``num_requests`` requests."""
        if not self.active:
            return True
        bucket = self._bucket(num_requests)
        if not bucket.enabled:
            if self.steps - bucket.off_since < bucket.cooldown:
                return False
            bucket.enabled, bucket.retrying = True, True  # try again: the workload may have changed
            bucket.drafted.clear()
            bucket.unjudged = 0
            self.decisions[bucket_of(num_requests), "on"] += 1
            logger.info("speculative decoding: drafting again at batch size ~%d after %d steps off",
                        bucket_of(num_requests), bucket.cooldown)
        # A step without drafts now and then keeps the plain rate measured while drafting is on.
        interval = self._probe_interval(bucket_of(num_requests))
        return self.steps % interval != interval - 1

    def observe(self, num_requests: int, num_tokens: int, seconds: float, drafted: bool) -> None:
        """A pure decode step: ``num_tokens`` new tokens for ``num_requests`` requests in ``seconds`` (for a
        step that verified drafts, including the time spent proposing them)."""
        self.steps += 1
        if not self.active or seconds <= 0 or num_tokens <= 0:
            return
        bucket = self._bucket(num_requests)
        if drafted:
            bucket.drafted.append((num_tokens, seconds))
            bucket.unjudged += 1
            if bucket.unjudged < JUDGE_EVERY:
                return  # judged on the next plain step or after JUDGE_EVERY drafted ones: the decision stays cheap
        else:
            bucket.plain.append(num_tokens / seconds)
        if (not bucket.enabled or len(bucket.drafted) < self._min_drafted(bucket_of(num_requests))
                or len(bucket.plain) < MIN_PLAIN_STEPS):
            return
        bucket.unjudged = 0
        with_drafts, without = bucket.drafted_rate(), statistics.median(bucket.plain)
        if with_drafts >= (1.0 - self.max_loss) * without:
            if bucket.retrying:  # the retry paid: a later loss starts from the first cooldown again
                bucket.retrying, bucket.cooldown = False, 0
            return
        size = bucket_of(num_requests)
        bucket.cooldown = min(2 * bucket.cooldown, self.max_cooldown_steps) if bucket.retrying \
            else self.cooldown_steps
        bucket.enabled, bucket.retrying, bucket.off_since = False, False, self.steps
        self.decisions[size, "off"] += 1
        logger.warning("speculative decoding: drafting off at batch size ~%d: %.1f tok/s with drafts vs %.1f "
                       "without over the last %d drafted steps (retried after %d steps)", size, with_drafts,
                       without, len(bucket.drafted), bucket.cooldown)
