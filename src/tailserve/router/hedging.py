"""Hedged requests and the budgets that keep extra copies from amplifying overload.

**Hedging.** An idempotent inference whose reply has not come after the model's recent p95
latency is sent again to another replica; the first reply wins and the other copy is
cancelled. Waiting for the p95 (rather than hedging at once) keeps the extra load near 5%
while cutting the tail that one slow replica (a GC pause, a noisy neighbour) would add.

`HedgePolicy` keeps the p95 per model over a sliding window: the last ``window`` reply
latencies, none older than ``max_age_s``, held sorted (``bisect.insort`` and a deletion per
sample: O(log n) comparisons and a memmove of at most ``window`` pointers, a microsecond or
two), so the quantile is exact over the window and read in O(1). A streaming estimate (P²,
t-digest) would use less memory but lags a shift in latency and is biased on small
samples; a window of a thousand floats costs nothing. Until ``min_samples`` replies are known
it answers None: no hedging on a guess. The delay is clamped to [min_delay_s, max_delay_s].

**Budgets.** `TokenBudget` is a token bucket filled by requests rather than time: each
original request earns ``ratio`` tokens, up to ``cap``; a hedge (or a retry) spends one. Over
any stretch of R requests at most ``ratio · R + cap`` extra copies go out (``cap`` bounds the
burst after a quiet stretch), so when every reply is slow (overload) hedging adds at most
``ratio`` to the load instead of doubling it. `HedgeBudget` defaults to 5%, `RetryBudget`
(a request that failed to connect is retried once on another replica) to 10%.

**Rationing.** Hedging at the p95 asks for a copy for about 5% of requests: the budget's
whole income. Most of them are a healthy replica's own tail (the p95 to p99 of normal
replies), and they would spend the tokens the truly stuck ones need: measured with one of
four replicas slow (5% of its replies 20 times late), 1.5% of requests found the bucket
empty when their hedge came due, and the p99.9 stayed on the slow replica. So a hedge goes
out at once only while the bucket holds at least half its ``cap`` (``plenty``). Below that
it waits (the dispatcher's queue, oldest first), and takes a token once the request has had
no reply for the model's recent p99 (``late_quantile``, from the same window): by then all
but 1% of healthy replies have come, so the token most likely goes to a stuck one. A request
that answers meanwhile leaves the queue.

One exception: a request on a *suspect* replica takes a token at its delay whenever there is
one. A replica is suspect when its requests lose to hedges far more often than its peers'
(`Pool.suspect`): 5% of its replies 20 times late means about 5% of its requests overtaken,
against well under 1% on a healthy one, whose tail mostly answers soon after the p95. Its
late requests are likely stuck, so they need not wait for the p99 to prove it. And when
there is no token at all, such a request waits apart and takes the next one, before the
queued requests of healthy replicas: those wait to be overdue anyway, and most of them
answer meanwhile.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

# Token arithmetic is in floats: 20 times 0.05 may come to 0.9999999999999999.
_TOLERANCE = 1e-9
# Below this share of its cap, a hedge budget is rationed (see above).
PLENTY_SHARE = 0.5


class TokenBudget:
    def __init__(self, *, ratio: float, cap: float = 10.0, initial: float = 0.0) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], not {ratio}")
        if cap < 1.0:
            raise ValueError(f"cap must be at least 1 (one copy), not {cap}")
        self.ratio = ratio
        self.cap = cap
        self._tokens = min(initial, cap)
        self.requests = 0
        self.spent = 0
        self.refused = 0

    @property
    def tokens(self) -> float:
        return self._tokens

    @property
    def ready(self) -> bool:
        """Whether a copy could go out now (without spending or counting a refusal)."""
        return self._tokens + _TOLERANCE >= 1.0

    @property
    def plenty(self) -> bool:
        """Whether the bucket holds at least half its cap (a hedge need not be rationed)."""
        return self._tokens + _TOLERANCE >= max(1.0, PLENTY_SHARE * self.cap)

    def earn(self) -> None:
        """Count one original request (never a hedge or a retry: copies earn nothing)."""
        self.requests += 1
        self._tokens = min(self.cap, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        """May one extra copy go out now? Spends a token when it may."""
        if self.ready:
            self._tokens = max(0.0, self._tokens - 1.0)
            self.spent += 1
            return True
        return self.refuse()

    def refuse(self) -> bool:
        """Count a copy that was due and not sent now; answers False."""
        self.refused += 1
        return False

    def refund(self) -> None:
        """Give back a token spent on a copy that could not be sent after all."""
        self._tokens = min(self.cap, self._tokens + 1.0)
        self.spent -= 1


class HedgeBudget(TokenBudget):
    def __init__(self, *, ratio: float = 0.05, cap: float = 10.0, initial: float = 0.0) -> None:
        super().__init__(ratio=ratio, cap=cap, initial=initial)


class RetryBudget(TokenBudget):
    def __init__(self, *, ratio: float = 0.1, cap: float = 10.0, initial: float = 0.0) -> None:
        super().__init__(ratio=ratio, cap=cap, initial=initial)


class HedgePolicy:
    """When to hedge one model's requests: after its recent p95, within its budget."""

    def __init__(
        self,
        *,
        quantile: float = 0.95,
        late_quantile: float = 0.99,
        window: int = 1000,
        max_age_s: float = 30.0,
        min_samples: int = 50,
        min_delay_s: float = 0.001,
        max_delay_s: float = 1.0,
        budget: TokenBudget | None = None,
    ) -> None:
        if not 0.0 < quantile <= late_quantile < 1.0:
            raise ValueError(
                f"need 0 < quantile ({quantile}) <= late_quantile ({late_quantile}) < 1"
            )
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples ({min_samples}) <= window ({window})")
        if not 0.0 <= min_delay_s <= max_delay_s:
            raise ValueError(f"need 0 <= min_delay_s ({min_delay_s}) <= max_delay_s")
        self.quantile = quantile
        self.late_quantile = late_quantile
        self.window = window
        self.max_age_s = max_age_s
        self.min_samples = min_samples
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.budget = budget if budget is not None else HedgeBudget()
        self._arrivals: deque[tuple[float, float]] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._sorted)

    def observe(self, latency_s: float, now: float) -> None:
        """A reply's latency (the attempt's own, from when that copy was sent)."""
        self._evict(now)
        if len(self._arrivals) >= self.window:
            self._drop()
        self._arrivals.append((now, latency_s))
        bisect.insort(self._sorted, latency_s)

    def quantile_s(self, now: float | None = None, quantile: float | None = None) -> float | None:
        """The window's ``quantile`` (nearest rank; the policy's own by default), or None with
        fewer than ``min_samples``."""
        if now is not None:
            self._evict(now)
        count = len(self._sorted)
        if count < self.min_samples:
            return None
        q = self.quantile if quantile is None else quantile
        return self._sorted[max(0, math.ceil(q * count) - 1)]

    def delay_s(self, now: float | None = None) -> float | None:
        """How long to wait for a reply before sending a hedge; None: do not hedge (too few
        samples to know the model's latency yet)."""
        value = self.quantile_s(now)
        if value is None:
            return None
        return min(self.max_delay_s, max(self.min_delay_s, value))

    def on_request(self, now: float) -> float | None:
        """An original request is sent: it earns its share of the budget. Answers the delay
        after which to hedge it (None: do not)."""
        self.budget.earn()
        return self.delay_s(now)

    def try_hedge(self, *, suspect: bool = False) -> bool:
        """The delay has passed with no reply: may a copy go out at once? While the budget
        is plentiful, or when the request waits on a ``suspect`` replica (one whose requests
        keep losing to hedges) and a token is there: then it spends a token. Otherwise the
        request waits for one (`may_hedge_late`), and the refusal is counted."""
        budget = self.budget
        return budget.try_spend() if budget.plenty or suspect else budget.refuse()

    def overdue_s(self, now: float | None = None) -> float | None:
        """How long a request waits, while the budget is rationed, before it may take a
        token: the recent ``late_quantile`` (clamped like the delay); None as for the delay."""
        value = self.quantile_s(now, self.late_quantile)
        if value is None:
            return None
        return min(self.max_delay_s, max(self.min_delay_s, value))

    def may_hedge_late(self, waited_s: float, now: float) -> bool:
        """A request refused at its delay has had no reply for ``waited_s``: may it take a
        token now? While the budget is plentiful, yes; otherwise once it is overdue and a
        token is there."""
        if self.budget.plenty:
            return True
        overdue = self.overdue_s(now)
        return self.budget.ready and overdue is not None and waited_s + _TOLERANCE >= overdue

    def _evict(self, now: float) -> None:
        while self._arrivals and now - self._arrivals[0][0] > self.max_age_s:
            self._drop()

    def _drop(self) -> None:
        _, latency = self._arrivals.popleft()
        del self._sorted[bisect.bisect_left(self._sorted, latency)]
