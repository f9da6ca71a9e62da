"""The cost model: how long a batch of ``rows`` takes, learnt online from observed batches.

Batched inference costs a fixed part (the call, the merge and split, the thread hand-off) plus
a part per row, so the model is ``t(rows) = fixed + per_row * rows``, fitted by exponentially
weighted least squares: each observation multiplies the weight of all earlier ones by
``decay``, so the fit follows drift (a noisy neighbour, a new version, a warmer cache) within
about ``1 / (1 - decay)`` batches. It is seeded by the warm-up runs, so the first real request
is scheduled with a real estimate.

When recent batches all had one size (steady load), the rows alone cannot separate the two
parts; the model then keeps the last per-row cost it could fit and moves the fixed part.

`bound` adds a margin of twice the model's recent absolute error, for decisions that must not
be late (deadlines); `predict` is the plain estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Before anything is observed: 1 ms a batch, whatever its size.
_DEFAULT_FIXED_S = 0.001


@dataclass(slots=True)
class LinearCost:
    decay: float = 0.95
    fixed_s: float = _DEFAULT_FIXED_S
    per_row_s: float = 0.0
    observations: int = 0
    # Exponentially weighted mean of |actual - predicted|, seconds.
    error_s: float = 0.0005
    _s0: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    # The same sums weighted by 1 / seconds**2 (each batch's error taken relative to its time).
    _rx: float = 0.0
    _rxx: float = 0.0

    @classmethod
    def with_prior(cls, fixed_s: float, per_row_s: float, *, decay: float = 0.95) -> LinearCost:
        """A model that starts from a guess (e.g. a neighbouring bucket's fit)."""
        return cls(decay=decay, fixed_s=fixed_s, per_row_s=per_row_s)

    def predict(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows

    def bound(self, rows: int) -> float:
        """A high estimate: the prediction plus twice the recent absolute error."""
        return self.predict(rows) + 2.0 * self.error_s

    def observe(self, rows: int, seconds: float) -> None:
        if seconds < 0 or rows < 1 or not math.isfinite(seconds):
            return
        if self.observations:
            # One outlier (a first allocation, a page-fault storm) must not blow the margin
            # up so far that the class's requests are all refused, and it never learns better.
            predicted = self.predict(rows)
            error = min(abs(seconds - predicted), predicted)
            self.error_s += 0.1 * (error - self.error_s)
        self.observations += 1
        d = self.decay
        x, y = float(rows), seconds
        self._s0 = d * self._s0 + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        relative = 1.0 / max(y, 1e-6)
        self._rx = d * self._rx + x * relative
        self._rxx = d * self._rxx + (x * relative) ** 2
        self._fit()

    def _fit(self) -> None:
        s0, sx, sy = self._s0, self._sx, self._sy
        spread = s0 * self._sxx - sx * sx
        mean_x, mean_y = sx / s0, sy / s0
        # The sizes must vary by a few percent (of their root mean square) to separate the parts.
        if spread > 1e-3 * s0 * self._sxx and spread > 0:
            per_row = (s0 * self._sxy - sx * sy) / spread
            if per_row < 0:
                # Bigger batches are not cheaper: a constant cost explains the data best.
                self.per_row_s, self.fixed_s = 0.0, mean_y
                return
            fixed = mean_y - per_row * mean_x
            if fixed < 0:
                # All of the cost is per row: a line through the origin, fitted to the batches'
                # errors relative to their times (timing noise grows with the time). In plain
                # seconds the largest batch would dictate the line: one cold 64-row warm-up
                # run priced every lone request after it at seven times its cost.
                self.per_row_s, self.fixed_s = self._rx / self._rxx, 0.0
                return
            self.per_row_s, self.fixed_s = per_row, fixed
            return
        # One batch size only: keep the per-row cost, move the fixed part to fit the mean.
        self.fixed_s = max(0.0, mean_y - self.per_row_s * mean_x)
        if self.fixed_s == 0.0:
            self.per_row_s = mean_y / mean_x
