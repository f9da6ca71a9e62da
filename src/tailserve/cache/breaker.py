"""A circuit breaker for the shared tier: after repeated failures stop asking, then probe.

Closed: calls go through; ``threshold`` failures in a row (errors or blown time budgets) open
it. Open: calls are skipped (the caller serves from L1 and the model) for a cool-down that
doubles on each failed probe, up to ``max_open_s``. Half-open: one call at a time goes through
as a probe; success closes the breaker, failure opens it again. Pure: the clock is passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Breaker:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        threshold: int = 5,
        open_s: float = 0.5,
        max_open_s: float = 10.0,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        self._clock = clock
        self.threshold = threshold
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self._on_change = on_change
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._open_s = open_s
        self._retry_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        """May a call go to the shared tier now? (In half-open state, one probe at a time.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() < self._retry_at:
                return False
            self._set(BreakerState.HALF_OPEN)
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self.failures = 0
        self._probing = False
        self._open_s = self.base_open_s
        if self.state is not BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)

    def release(self) -> None:
        """A call that ended with no verdict (cancelled): in half-open state, the next call
        may probe (else none ever would again)."""
        self._probing = False

    def failure(self) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._probing = False
            self._open_s = min(self._open_s * 2, self.max_open_s)
            self._open()
        elif self.state is BreakerState.CLOSED and self.failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self._retry_at = self._clock() + self._open_s
        self._set(BreakerState.OPEN)

    def _set(self, state: BreakerState) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)
