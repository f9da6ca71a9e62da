"""The audit of refusals: was a refusal needed, judged by what the admitted requests met.

Admission refuses on a prediction (the work ahead, the event loop's backlog). A prediction can
be wrong: beside a neighbour that takes the CPU in slices, the backlog a fresh worker reads
after each slice is a burst, and it refused healthy load while the requests it let in were
answered in half their SLO. So every refusal is checked against the evidence: the p99 latency of
the requests this model answered over the last second. A refusal while that sits at most
``comfortable`` of the SLO (half), and the event loop has time to spare, is a false refusal:
counted as such (`tailserve_false_refusals_total`), and not counted against the admission share
(`engine.admission`), which would otherwise fall and refuse more. (Under overload the admitted
requests are answered quickly too, admission sees to that; but the loop is then saturated, and
the requests waiting in the kernel for it, which the worker cannot time, are what make a
refusal needed.)

Latencies go into a histogram of fixed log-spaced buckets over two half windows: adding one is a
few operations, and the verdict is worked out at most every few milliseconds.
"""

from __future__ import annotations

import math

# Buckets: 50 µs, growing by a quarter, up to ~40 s.
_FIRST_S = 50e-6
_GROWTH = 1.25
_BUCKETS = 64
_LOG_GROWTH = math.log(_GROWTH)
# The verdict holds this long before it is worked out again.
_VERDICT_S = 0.01
# From this share of its thread's time busy, the event loop is saturated: a refusal is needed
# however quickly the admitted requests are answered.
SATURATED = 0.85


def _bucket(seconds: float) -> int:
    if seconds <= _FIRST_S:
        return 0
    return min(_BUCKETS - 1, 1 + int(math.log(seconds / _FIRST_S) / _LOG_GROWTH))


def _upper(index: int) -> float:
    return _FIRST_S * _GROWTH**index


class RefusalAudit:
    """Whether the admitted requests are comfortably within ``slo_s`` now."""

    def __init__(
        self,
        slo_s: float,
        *,
        comfortable: float = 0.5,
        window_s: float = 1.0,
        quantile: float = 0.99,
        least_answers: int = 20,
    ) -> None:
        self.slo_s = slo_s
        self.comfortable_s = comfortable * slo_s
        self._half_s = window_s / 2
        self._quantile = quantile
        self._least = least_answers
        # The older and the current half window's counts, and when the current one began.
        self._older = [0] * _BUCKETS
        self._current = [0] * _BUCKETS
        self._began = -math.inf
        self._verdict = (-math.inf, False)

    def on_answer(self, latency_s: float, now: float) -> None:
        """An admitted request was answered ``latency_s`` after it arrived."""
        self._roll(now)
        self._current[_bucket(latency_s)] += 1

    def needless(self, now: float, loop_busy: float) -> bool:
        """Whether a refusal now is a false one: the admitted requests comfortably within the
        SLO, and the event loop not saturated (``loop_busy``, 0..1)."""
        return loop_busy < SATURATED and self.comfortable(now)

    def comfortable(self, now: float) -> bool:
        """Whether the last second's answers (enough of them) had a p99 within the
        comfortable share of the SLO: a refusal now would be a false one."""
        at, verdict = self._verdict
        if 0.0 <= now - at < _VERDICT_S:
            return verdict
        self._roll(now)
        verdict = self._p99_within(now)
        self._verdict = (now, verdict)
        return verdict

    def p99_s(self, now: float) -> float:
        """The last second's p99 (the upper edge of its bucket; nan: no answers)."""
        self._roll(now)
        counts = [a + b for a, b in zip(self._older, self._current, strict=True)]
        total = sum(counts)
        if not total:
            return math.nan
        rank = self._quantile * total
        seen = 0
        for index, count in enumerate(counts):
            seen += count
            if seen >= rank:
                return _upper(index)
        return _upper(_BUCKETS - 1)

    def _p99_within(self, now: float) -> bool:
        total = sum(self._older) + sum(self._current)
        if total < self._least:
            return False  # too little evidence: the prediction stands
        return self.p99_s(now) <= self.comfortable_s

    def _roll(self, now: float) -> None:
        elapsed = now - self._began
        if elapsed < self._half_s:
            return
        if elapsed < 2 * self._half_s:
            self._older, self._current = self._current, [0] * _BUCKETS
        else:  # a whole window went by with nothing: both halves are empty
            self._older, self._current = [0] * _BUCKETS, [0] * _BUCKETS
        self._began = now
