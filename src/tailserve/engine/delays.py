"""The delays outside a model's queue and run that the deadline batcher counts on.

Read from the event loop before each decision: its lag and its backlog. Learnt from what ran: a
batch's hand-off overhead (to its thread and back to the loop), and a correction, how much later
than estimated admitted requests were answered. What was learnt fades when nothing new comes,
or an overload's value would outlive it: every request refused for it, nothing run to unlearn it.
"""

from __future__ import annotations

import math

# The weight of each answered request in the correction; what was learnt fades with this time
# constant (seconds).
_CORRECTION_RATE = 0.01
_CORRECTION_TAU_S = 0.5
# What was learnt, faded, is worked out again at most this often, or when a batch or an answer
# teaches something new: not on every request.
_LEARNT_REFRESH_S = 0.001
# The most hand-off overhead a batch teaches: a loop stalled for a moment says nothing of the
# next batch's hand-off.
_MAX_OVERHEAD_S = 0.02


def _faded(value: float, learnt_at: float, now: float) -> float:
    return value * math.exp(-max(0.0, now - learnt_at) / _CORRECTION_TAU_S)


class Delays:
    def __init__(self) -> None:
        # How late the event loop runs what is ready: an answer waits about that long before
        # it goes out. (The wait before its request was read is in its budget already.)
        self.loop_delay_s = 0.0
        # The loop's time the requests it holds still need (observability.loop_lag).
        self.loop_backlog_s = 0.0
        # How busy the loop's thread is, 0..1 (its CPU time over wall time, moving average).
        self.loop_busy = 0.0
        # A batch's hand-off overhead (moving average), and when it was last learnt.
        self.overhead_s = 0.0
        self._overhead_at = 0.0
        # How much later than estimated admitted requests were answered (moving average).
        self.correction_s = 0.0
        self._corrected_at = 0.0
        # `learnt`'s last answer, and when it was worked out.
        self._learnt_s = (0.0, 0.0)
        self._learnt_at = -math.inf

    def learn_overhead(self, overhead_s: float, now: float | None) -> None:
        """A batch's hand-off took ``overhead_s``, answered at ``now`` (None: no clock, no
        fading)."""
        learnt = self.overhead_s if now is None else self.overhead(now)
        self.overhead_s = learnt + 0.05 * (min(overhead_s, _MAX_OVERHEAD_S) - learnt)
        if now is not None:
            self._overhead_at = now
        self._learnt_at = -math.inf

    def learn_answer(self, estimate: float, done: float) -> None:
        """A request admitted with ``estimate`` was answered at ``done``."""
        if self._corrected_at != done:  # (a batch's members are done at once: faded once)
            self.correction_s = self.correction(done)
        self.correction_s += _CORRECTION_RATE * (done - estimate - self.correction_s)
        self._corrected_at = done
        self._learnt_at = -math.inf

    def overhead(self, now: float) -> float:
        """The hand-off overhead, faded since it was last learnt."""
        return _faded(self.overhead_s, self._overhead_at, now)

    def correction(self, now: float) -> float:
        return _faded(self.correction_s, self._corrected_at, now)

    def learnt(self, now: float) -> tuple[float, float]:
        """The learnt delays, faded: the hand-off overhead, and it plus the correction (when
        positive)."""
        if not 0.0 <= now - self._learnt_at < _LEARNT_REFRESH_S:
            overhead = self.overhead(now)
            self._learnt_s = (overhead, overhead + max(0.0, self.correction(now)))
            self._learnt_at = now
        return self._learnt_s
