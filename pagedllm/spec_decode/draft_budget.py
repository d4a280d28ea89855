"""``DraftBudget``: how many tokens each request drafts this step, from what drafts have cost and earned so far.

Every draft token is one more row for the target to verify, and on a CPU a row is not free: past a few rows a
step is compute-bound (the LM head alone is vocab x hidden multiply-adds per row), and with 8 requests in a step
16 drafts each would multiply its rows by 17. So the budget weighs each draft token's expected gain against its
cost, per request, from quantities measured as the engine runs:

- **cost**: the time of a pure decode step is close to ``fixed + per_row x rows + verify x verified`` (rows: the
  step's query tokens, one per request plus its drafts; ``verified``: whether it checked drafts). Per batch-size
  bucket a least-squares fit through the lower quartile of each kind of step gives ``per_row``, the verifier's
  marginal cost of a row at that batch size (proposing is measured apart and left out; a machine shared with other
  work only adds time to a step, which the quartile leaves out). A proposer's own CPU time per request is a
  cost too.
- **gain**: the chance that drafts 1..i are all accepted, taken as ``alpha ** i`` where ``alpha`` is the
  request's estimated chance that a draft token is accepted given the ones before it were. Acceptance is
  bimodal (a request copies for a while, then writes new text), so ``alpha`` is kept apart for two states: after
  a step that accepted all its drafts, and after one that rejected some. Each is the request's own record (recent
  steps weigh more) pulled toward the same state's figure over all requests.

A step's plan maximises its expected tokens per second, (requests + gains) / (plain step + costs + ``verify``):
Dinkelbach's iteration, whose inner problem has a closed form per request (draft while ``alpha ** i`` exceeds the
current rate x ``per_row``, and only if the run earns more than it costs, proposing included). A request whose
plan is 0 for ``PROBE_EVERY`` steps drafts ``PROBE_DRAFTS`` tokens once, so its estimate can recover. A bucket
without a cost line borrows the nearest bucket's; while none has one, each request drafts at most
``COLD_DRAFTS`` (those steps are the evidence). No torch here.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from pagedllm.logger import init_logger
from pagedllm.spec_decode.governor import bucket_of

logger = init_logger(__name__)

COST_WINDOW = 128  # pure decode steps kept per bucket for the cost line
MIN_COST_STEPS = 16
PER_KIND = 16  # recent steps kept per (rows, verified) kind
MIN_PER_KIND = 3  # steps a kind needs to count (its lower quartile then survives one disturbed step)
COLD_DRAFTS = 4  # drafts per request while no batch size has a cost line yet
REFIT_EVERY = 16
LOG_EVERY = 4096  # steps between log lines of a bucket's cost line (and when it first has one)
MIN_ROW_SPREAD = 0.5  # standard deviation of the rows, below which the line's slope is not trusted
MIN_EACH_KIND = 2  # plain and verifying steps each, for the line to tell verifying's own cost apart
REQUEST_DECAY = 0.9  # per verification: a request's older steps fade (its text changes phase)
GLOBAL_DECAY = 0.99
PRIOR_WEIGHT = 4.0  # the all-requests estimate counts as this many of the request's own verified drafts
PROBE_EVERY = 16
PROBE_DRAFTS = 2
MAX_ALPHA = 0.995


class _CostLine:
    """Seconds of a step on (1, rows, verified), fitted to the lower quartile of the recent steps of each kind.

    ``verified`` (0 or 1: the step checked drafts) carries what verifying costs whatever the rows: the rejection
    sampler's own passes, and on some CPUs a matmul kernel for several rows that differs from the one-row one.
    A machine shared with other work only ever adds time to a step, so each (rows, verified) kind counts at the
    lower quartile of its last ``PER_KIND`` steps, and the line is a least-squares fit through those, weighted by
    how many steps each holds. Refitted every ``REFIT_EVERY`` steps, so the plan's cost stays O(1) a step."""

    def __init__(self) -> None:
        self.kinds: dict[tuple[int, int], deque[float]] = {}
        self.order: deque[tuple[int, int]] = deque()  # the kinds of the last COST_WINDOW steps, oldest first
        self.in_window: Counter[tuple[int, int]] = Counter()
        self.since_fit = 0
        self.added = 0
        self._line: tuple[float, float, float] | None = None

    def add(self, rows: int, verified: bool, seconds: float) -> None:
        kind = (rows, int(verified))
        self.kinds.setdefault(kind, deque(maxlen=PER_KIND)).append(seconds)
        self.order.append(kind)
        self.in_window[kind] += 1
        if len(self.order) > COST_WINDOW:  # the oldest step leaves the window (and its kind, if still kept)
            old = self.order.popleft()
            self.in_window[old] -= 1
            kept = self.kinds[old]
            if len(kept) > self.in_window[old]:
                kept.popleft()
            if not kept:
                del self.kinds[old], self.in_window[old]
        self.added += 1
        self.since_fit += 1
        if self.since_fit >= REFIT_EVERY or self.added <= COST_WINDOW // 2:  # young: every step
            self.since_fit = 0
            self._line = self._fit()

    def _fit(self) -> tuple[float, float, float] | None:
        if len(self.order) < MIN_COST_STEPS:
            return None
        kinds = [(kind, kept) for kind, kept in self.kinds.items() if len(kept) >= MIN_PER_KIND]
        if len(kinds) < 2:
            return None
        x = np.array([(1.0, rows, verified) for (rows, verified), _ in kinds])
        y = np.array([_lower_quartile(kept) for _, kept in kinds])
        w = np.array([float(len(kept)) for _, kept in kinds])
        mean_rows = float(w @ x[:, 1] / w.sum())
        if float(w @ (x[:, 1] - mean_rows) ** 2 / w.sum()) < MIN_ROW_SPREAD ** 2:
            return None  # no spread in rows: no slope to trust
        verified = float(w @ x[:, 2])
        sw = np.sqrt(w)
        if MIN_EACH_KIND <= verified <= w.sum() - MIN_EACH_KIND:
            coef, _, rank, _ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
            if rank == 3 and coef[1] >= 0.0 and coef[2] >= 0.0:
                return float(coef[0]), float(coef[1]), float(coef[2])
        # Verifying's own cost cannot be told apart (or came out negative): a line on rows alone.
        coef, _, rank, _ = np.linalg.lstsq(x[:, :2] * sw[:, None], y * sw, rcond=None)
        if rank < 2:
            return None
        if coef[1] < 0.0:  # more rows never cost less: a flat line at the mean
            return float(w @ y / w.sum()), 0.0, 0.0
        return float(coef[0]), float(coef[1]), 0.0

    def line(self) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per row, seconds of verifying at all), or None until the window holds enough
        steps of different sizes."""
        return self._line


def _lower_quartile(values: deque[float]) -> float:
    """The 25th percentile, interpolated between neighbours (numpy's default), of a few values: plain Python is
    faster than an array for 16 of them."""
    ordered = sorted(values)
    at = 0.25 * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@dataclass
class _Record:
    """Decayed counts of accepted and rejected draft tokens (the geometric model's successes and failures)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: int, rejected: int, decay: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + rejected


@dataclass
class _Request:
    records: tuple[_Record, _Record] = field(default_factory=lambda: (_Record(), _Record()))
    state: int = 0  # 1: its last verified drafts were all accepted
    idle: int = 0  # steps in a row it could have drafted and was planned none


def expected_accepted(alpha: float, drafts: int) -> float:
    """Expected accepted tokens of ``drafts`` drafts whose i-th is accepted with chance ``alpha ** i``."""
    if drafts <= 0:
        return 0.0
    if alpha >= 1.0:
        return float(drafts)
    return alpha * (1.0 - alpha ** drafts) / (1.0 - alpha)


def drafts_worth(alpha: float, threshold: float, room: int) -> int:
    """The most drafts (<= ``room``) whose last one still earns more than ``threshold`` (alpha ** d > threshold)."""
    if room <= 0 or alpha <= threshold:
        return 0
    if threshold <= 0.0 or alpha >= 1.0:
        return room
    return max(0, min(room, math.ceil(math.log(threshold) / math.log(alpha)) - 1))


class DraftBudget:
    """Plans each step's drafts per request (``plan``) from step costs (``observe_step``), proposing costs
    (``observe_proposer``) and verified drafts (``record``)."""

    def __init__(self) -> None:
        self.costs: dict[int, _CostLine] = {}
        self.requests: dict[str, _Request] = {}
        self.global_records = (_Record(), _Record())
        self.proposer_seconds = 0.0  # per proposing request, a moving average
        self._proposer_seen = False

    # ---- evidence ------------------------------------------------------------------------------------
    def observe_step(self, num_requests: int, rows: int, verified: bool, seconds: float) -> None:
        """A pure decode step of ``num_requests`` requests and ``rows`` query tokens that checked drafts or not
        (``verified``), ``seconds`` without proposing."""
        if seconds <= 0 or rows <= 0:
            return
        bucket = bucket_of(num_requests)
        cost = self.costs.setdefault(bucket, _CostLine())
        had_line = cost.line() is not None
        cost.add(rows, verified, seconds)
        line = cost.line()
        if line is not None and (not had_line or cost.added % LOG_EVERY == 0):
            logger.info("speculative decoding: at batch size ~%d a decode step costs %.2f ms + %.3f ms a row "
                        "(+%.2f ms when it verifies drafts)", bucket, 1e3 * line[0], 1e3 * line[1], 1e3 * line[2])

    def observe_proposer(self, seconds: float, num_jobs: int) -> None:
        """The proposer took ``seconds`` (its thread's CPU time) for ``num_jobs`` requests that drafted."""
        if num_jobs <= 0:
            return
        per_job = seconds / num_jobs
        self.proposer_seconds = per_job if not self._proposer_seen else 0.9 * self.proposer_seconds + 0.1 * per_job
        self._proposer_seen = True

    def record(self, req_id: str, drafted: int, accepted: int) -> None:
        """The target verified ``drafted`` drafts of the request and accepted the first ``accepted``."""
        if drafted <= 0:
            return
        request = self.requests.setdefault(req_id, _Request())
        rejected = 1 if accepted < drafted else 0
        request.records[request.state].add(accepted, rejected, REQUEST_DECAY)
        self.global_records[request.state].add(accepted, rejected, GLOBAL_DECAY)
        request.state = 1 - rejected

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ---- the plan ------------------------------------------------------------------------------------
    def alpha(self, req_id: str) -> float:
        """The request's chance that a draft token is accepted after the ones before it were, in its state."""
        request = self.requests.get(req_id) or _Request()
        shared = self.global_records[request.state]
        prior = (shared.accepted + 1.0) / (shared.accepted + shared.rejected + 2.0)
        own = request.records[request.state]
        value = (own.accepted + PRIOR_WEIGHT * prior) / (own.accepted + own.rejected + PRIOR_WEIGHT)
        return min(value, MAX_ALPHA)

    def cost_line(self, num_requests: int) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per row, seconds of verifying at all) of a step at this batch size: its
        bucket's line, or the nearest bucket's while it has none (a row costs about the same either side)."""
        bucket = bucket_of(num_requests)
        lines = [(abs(math.log2(size / bucket)), line.line()) for size, line in self.costs.items()]
        lines = sorted((distance, line) for distance, line in lines if line is not None)
        return lines[0][1] if lines else None

    def plan(self, rooms: dict[str, int], num_requests: int) -> dict[str, int]:
        """``rooms``: per request that may draft, the most drafts it may get; ``num_requests``: the step's
        requests (drafting or not). Returns per request the drafts to propose (0: none, not even the proposer's
        run)."""
        line = self.cost_line(num_requests)
        if line is None:  # no cost line yet: a few drafts each, whose verifying steps are the evidence
            return {rid: min(room, COLD_DRAFTS) for rid, room in rooms.items()}
        fixed, per_row, verify = line
        plain = max(fixed + per_row * num_requests, 1e-9)
        alphas = {rid: self.alpha(rid) for rid in rooms}
        best, best_rate = {}, num_requests / plain
        for _ in range(8):  # Dinkelbach: each round's plan beats the rate it was planned at, or it stops
            chosen, gain, cost = {}, float(num_requests), plain
            for rid, room in rooms.items():
                d = drafts_worth(alphas[rid], best_rate * per_row, room)
                earned, spent = expected_accepted(alphas[rid], d), per_row * d + self.proposer_seconds
                if d > 0 and earned > best_rate * spent:
                    chosen[rid] = d
                    gain, cost = gain + earned, cost + spent
            rate = gain / (cost + verify) if chosen else gain / cost
            if rate <= best_rate * (1.0 + 1e-9):
                break
            best, best_rate = chosen, rate
        out = {}
        for rid, room in rooms.items():
            request = self.requests.setdefault(rid, _Request())
            d = best.get(rid, 0)
            if d == 0 and room > 0:
                request.idle += 1
                if request.idle >= PROBE_EVERY:  # a look now and then: its text may have turned copyable
                    d = min(room, PROBE_DRAFTS)
            if d > 0:
                request.idle = 0
            out[rid] = d
        return out
