"""Which replicas may take traffic: active readiness checks and passive outlier ejection.

**Active checks** (`ActiveHealth`): the proxy polls each backend's ``GET /v2/health/ready``
and reports the answers here; ``unhealthy_after`` failed checks in a row take a backend out,
``healthy_after`` passing ones bring it back. A worker that is loading, warming or draining
answers not ready, so this is also how a drain empties a backend without errors.

**Outlier ejection** (`OutlierDetector`), from the replies themselves, as Envoy does it:

- ``consecutive_failures`` errors or timeouts in a row (a failed connect counts), or
- a latency outlier: its EWMA latency, over at least ``min_samples`` replies, above
  ``latency_factor`` times the median of the other backends' (those in service and with no
  failure in the last ``reference_quiet_s``: a dead replica's last average is no reference,
  even when replies it sent before dying are read after) and above ``latency_floor_s``
  (at sub-millisecond latencies three times the median is still no problem worth a replica);
- a *limping* replica, one whose requests keep losing to hedges: at least
  ``overtaken_min_losses`` of its last few hundred first copies beaten by a hedge sent
  elsewhere, a share of them at least ``overtaken_share`` and ``overtaken_factor`` times the
  median of the others' (the same peers as for latency, with ``min_samples`` first copies
  each; at least ``overtaken_min_peers`` of them: in a pool of two the reference is one
  replica, and when both slow down alike whichever loses a few more races would be taken
  out, halving the pool). A replica that stalls now and then (5% of its replies 20 times
  late) keeps an average latency too close to the others' for the latency test, but loses
  nearly all its stalled requests to hedges, while a healthy replica's tail seldom loses to a
  copy sent at the p95. It needs hedging on: without hedges nothing is overtaken.

An ejected backend gets no traffic for a backoff of ``base_ejection_s · 2^k`` (capped at
``max_ejection_s``), k being how often it was ejected before; a *slow* one (latency outlier
or limping) from ``slow_base_ejection_s`` (the router's is 30 s, Envoy's default base): a
replica that stalls (GC storms, a noisy neighbour, a failing disk) tends to go on stalling for
a while, and every return costs the requests that prove it again (five overtaken ones at
least), while one whose connects failed has usually been restarted, and its readiness check
says when it is back. Its failure streak and latency average are reset when it is ejected
(and the late replies of what it had in flight are ignored), so after the backoff it is
re-admitted with a clean slate and only new evidence can eject it again. Once it has stayed in
for ``reset_after_s``, k starts again from 0. At most
``max_ejected_fraction`` of a pool (rounded down) is ejected at once: when the whole pool
fails (a bad model version, Redis down) ejecting it all would only turn errors into 503s and
concentrate the load on what is left.

Pure: the time is passed in; the backends' state lives on the `Backend` objects.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from tailserve.router.backends import Backend, Pool


@dataclass(frozen=True, slots=True)
class Ejection:
    """A backend taken out of rotation (for the log and the ``backend ejections`` metric)."""

    backend_id: str
    reason: str  # "failures", "latency" or "overtaken"
    until: float
    backoff_s: float


class OutlierDetector:
    def __init__(
        self,
        *,
        consecutive_failures: int = 5,
        latency_factor: float = 3.0,
        latency_floor_s: float = 0.05,
        min_samples: int = 20,
        overtaken_share: float = 0.02,
        overtaken_factor: float = 3.0,
        overtaken_min_losses: int = 5,
        overtaken_min_peers: int = 2,
        base_ejection_s: float = 5.0,
        slow_base_ejection_s: float | None = None,
        max_ejection_s: float = 120.0,
        reset_after_s: float = 60.0,
        max_ejected_fraction: float = 0.5,
    ) -> None:
        if consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be at least 1, not {consecutive_failures}")
        if not 0.0 < base_ejection_s <= max_ejection_s:
            raise ValueError(f"need 0 < base_ejection_s ({base_ejection_s}) <= max_ejection_s")
        slow_base = base_ejection_s if slow_base_ejection_s is None else slow_base_ejection_s
        if not 0.0 < slow_base <= max_ejection_s:
            raise ValueError(f"need 0 < slow_base_ejection_s ({slow_base}) <= max_ejection_s")
        if overtaken_min_losses < 1:
            raise ValueError(f"overtaken_min_losses must be at least 1, not {overtaken_min_losses}")
        if not 0.0 <= max_ejected_fraction <= 1.0:
            raise ValueError(f"max_ejected_fraction must be in [0, 1], not {max_ejected_fraction}")
        self.consecutive_failures = consecutive_failures
        self.latency_factor = latency_factor
        self.latency_floor_s = latency_floor_s
        self.min_samples = min_samples
        # A backend that failed within this long is no reference for another's latency.
        self.reference_quiet_s = 5.0
        self.overtaken_share = overtaken_share
        self.overtaken_factor = overtaken_factor
        self.overtaken_min_losses = overtaken_min_losses
        self.overtaken_min_peers = overtaken_min_peers
        self.base_ejection_s = base_ejection_s
        self.slow_base_ejection_s = slow_base
        self.max_ejection_s = max_ejection_s
        self.reset_after_s = reset_after_s
        self.max_ejected_fraction = max_ejected_fraction

    def observe(self, pool: Pool, backend: Backend, now: float) -> Ejection | None:
        """Judge a backend after the pool recorded one of its attempts (finish or failed
        connect). Answers the ejection, if this made one."""
        self._readmit(backend, now)
        if backend.is_ejected(now):
            # The late replies of attempts sent before the ejection say nothing new: they must
            # not count against the backend once it is back.
            backend.reset_stats()
            return None
        if backend.consecutive_failures >= self.consecutive_failures:
            return self.eject(pool, backend, now, "failures")
        if self.is_latency_outlier(pool, backend, now):
            return self.eject(pool, backend, now, "latency")
        if self.is_limping(pool, backend, now):
            return self.eject(pool, backend, now, "overtaken")
        return None

    def is_latency_outlier(self, pool: Pool, backend: Backend, now: float) -> bool:
        latency = backend.latency_s
        if latency is None or backend.samples < self.min_samples:
            return False
        if latency <= self.latency_floor_s:
            return False
        # The others' median, not the pool's: in a pool of two the slow one would pull the
        # median up with it and could never be three times it. Only others that answer: a
        # replica that has just died keeps the average of its last replies, and the survivor,
        # slower under the load it took over, must not be judged (and ejected, leaving none)
        # against that; nor against one that failed in the last few seconds (a killed
        # worker's replies still in its socket read as successes after its first failures).
        others = [
            b.latency_s
            for b in self._peers(pool, backend, now)
            if b.latency_s is not None and b.samples >= self.min_samples
        ]
        if not others:
            return False
        return latency > self.latency_factor * statistics.median(others)

    def is_limping(self, pool: Pool, backend: Backend, now: float) -> bool:
        losses = backend.first_losses
        if losses < self.overtaken_min_losses or not backend.first_copies:
            return False
        share = losses / backend.first_copies
        if share < self.overtaken_share:
            return False
        others = [
            b.first_losses / b.first_copies
            for b in self._peers(pool, backend, now)
            if b.first_copies >= self.min_samples
        ]
        if len(others) < max(1, self.overtaken_min_peers):
            return False
        return share >= self.overtaken_factor * statistics.median(others)

    def _peers(self, pool: Pool, backend: Backend, now: float) -> list[Backend]:
        """The others ``backend`` may be judged against: in service, and with no failure
        lately (none in a row now, none in the last ``reference_quiet_s``)."""
        return [
            b
            for b in pool
            if b is not backend
            and b.in_service(now)
            and not b.consecutive_failures
            and (b.failed_at is None or now - b.failed_at >= self.reference_quiet_s)
        ]

    def eject(self, pool: Pool, backend: Backend, now: float, reason: str) -> Ejection | None:
        """Take a backend out for its backoff, unless the pool's ejection cap is reached."""
        if backend.is_ejected(now):
            return None
        allowed = math.floor(self.max_ejected_fraction * len(pool) + 1e-9)
        if len(pool.ejected(now)) + 1 > allowed:
            return None
        self._forgive(backend, now)
        base = self.base_ejection_s if reason == "failures" else self.slow_base_ejection_s
        backoff = min(self.max_ejection_s, base * 2.0**backend.ejections)
        backend.ejections += 1
        backend.ejected_until = now + backoff
        backend.readmitted_at = None
        # It comes back with a clean slate: only new evidence may eject it again.
        backend.reset_stats()
        return Ejection(backend.id, reason, backend.ejected_until, backoff)

    def readmit(self, pool: Pool, now: float) -> list[Backend]:
        """Re-admit the backends whose backoff is over. The balancers send to them again as
        soon as the backoff ends either way; this (or `observe`, lazily) starts the clock after
        which their doubling is forgotten, and answers them for the log."""
        return [backend for backend in pool if self._readmit(backend, now)]

    def _readmit(self, backend: Backend, now: float) -> bool:
        if backend.ejected_until is None or now < backend.ejected_until:
            return False
        # Back since its backoff ended, however much later this notices it.
        backend.readmitted_at = backend.ejected_until
        backend.ejected_until = None
        return True

    def _forgive(self, backend: Backend, now: float) -> None:
        """A backend that has stayed in long enough starts its backoff from the base again."""
        since = backend.readmitted_at
        if since is not None and now - since >= self.reset_after_s:
            backend.ejections = 0
            backend.readmitted_at = None


class ActiveHealth:
    """Turns the readiness checks' answers into each backend's ``healthy`` flag."""

    def __init__(self, *, unhealthy_after: int = 2, healthy_after: int = 1) -> None:
        if unhealthy_after < 1 or healthy_after < 1:
            raise ValueError("unhealthy_after and healthy_after must be at least 1")
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        # Checks in a row that disagree with the backend's current flag, by backend id.
        self._streak: dict[str, int] = {}

    def record(self, backend: Backend, ready: bool) -> bool:
        """One check's answer (a failed connect or a timeout is not ready). Answers whether
        the backend's flag changed."""
        if ready == backend.healthy:
            self._streak.pop(backend.id, None)
            return False
        streak = self._streak.get(backend.id, 0) + 1
        if streak < (self.healthy_after if ready else self.unhealthy_after):
            self._streak[backend.id] = streak
            return False
        self._streak.pop(backend.id, None)
        backend.healthy = ready
        return True
