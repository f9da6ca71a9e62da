"""When to start a dead worker again: after a short delay, which doubles while it keeps dying,
up to a cap. A worker that stayed up a while is healthy again: its next failure starts from
the first delay. Pure: the times are passed in."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tailserve.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    first_s: float = 0.5
    cap_s: float = 10.0
    # A worker that ran at least this long before it died is not crash-looping.
    stable_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 < self.first_s <= self.cap_s:
            raise ConfigError(f"restart backoff must be 0 < first ({self.first_s}) <= cap")


class RestartPolicy:
    """The restart delays of one worker.

    A worker that dies as it starts (a bad repository, a port taken) would otherwise be
    started again hundreds of times a second, each start costing seconds of model loading.
    """

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self._next_s = self.backoff.first_s

    def delay(self, *, started_at: float, exited_at: float) -> float:
        """Seconds to wait before restarting a worker that ran from ``started_at`` until it
        exited at ``exited_at`` (both on one monotonic clock)."""
        if exited_at - started_at >= self.backoff.stable_s:
            self._next_s = self.backoff.first_s
        delay = self._next_s
        self._next_s = min(delay * 2, self.backoff.cap_s)
        return delay


# The front door's first restart: every request waits on it, and it starts in a few hundred
# milliseconds (no models to load), so it is started again almost at once.
FRONT_DOOR_FIRST_S = 0.1


def front_door_backoff(backoff: Backoff) -> Backoff:
    """``backoff`` for the front door: its first delay at most `FRONT_DOOR_FIRST_S`."""
    return replace(backoff, first_s=min(backoff.first_s, FRONT_DOOR_FIRST_S))
