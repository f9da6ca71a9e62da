"""How much job work a worker takes on: only what its online requests leave free.

The background lane (engine/background.py) keeps a job's batches off an instance an online
request needs, but a job also costs the event loop (its body read and checked, its result
written, the store's round trips: about a millisecond of CPU for a 20-row churn job, several
online requests' worth) and the machine's cores, which the online requests of this worker and
of its neighbours share. So the jobs a worker holds at once follow the loop's health, as a
congestion window does a network's: while the loop runs on time and is far from saturated,
one more each interval (up to the most configured); when it runs late (the machine's cores
are contended) or its thread is busy near saturation, half as many, and none added for a
while. A new submission is held while the loop is in that state (`desk.JobDesk`; refused with 429
after a while): accepting a burst of them is work the online requests would wait behind, and
refusing them at once would bring them straight back. With no online
request of late, the loop is the jobs' alone: as many as configured, and every submission.
"""

from __future__ import annotations

from dataclasses import dataclass

# The loop's measures are moving averages over a few hundred milliseconds: the window changes
# at most this often, so that one spell is not counted many times.
STEP_S = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class PacingConfig:
    max_jobs: int = 4
    # The loop is pressed above either high mark, and has room below both low ones.
    lag_high_s: float = 0.003
    lag_low_s: float = 0.0015
    busy_high: float = 0.6
    busy_low: float = 0.45
    # After a press, no job is added for this long.
    hold_s: float = 1.0


class Pacer:
    def __init__(self, config: PacingConfig = PacingConfig()) -> None:
        self.config = config
        # Jobs that may be held at once now; it starts at one, as a window starts small.
        self.limit = min(1, config.max_jobs)
        self.pressed = False
        self._quiet_from = 0.0  # no job is added before then
        self._changed_at = -1.0  # the last cut or growth: one change a STEP_S at most

    def pressing(self, *, lag_s: float, busy: float, online: bool = True) -> bool:
        """Whether the loop, in this state, has no room for job work (``online``: online
        requests came of late; with none, nothing needs the room)."""
        return online and (lag_s > self.config.lag_high_s or busy > self.config.busy_high)

    def update(self, now: float, *, lag_s: float, busy: float, online: bool = True) -> int:
        """Take the loop's state at ``now``; the jobs that may be held."""
        config = self.config
        if not online:  # the loop is the jobs' alone
            self.pressed = False
            self.limit = config.max_jobs
            return self.limit
        self.pressed = self.pressing(lag_s=lag_s, busy=busy)
        due = now - self._changed_at >= STEP_S - 1e-9
        if self.pressed:
            self._quiet_from = now + config.hold_s
            if due and self.limit:
                self.limit //= 2
                self._changed_at = now
        elif self.limit < config.max_jobs and due and self._room(now, lag_s, busy):
            self.limit += 1
            self._changed_at = now
        return self.limit

    def _room(self, now: float, lag_s: float, busy: float) -> bool:
        config = self.config
        return lag_s < config.lag_low_s and busy < config.busy_low and now >= self._quiet_from
