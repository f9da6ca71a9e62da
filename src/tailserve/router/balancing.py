"""Choosing one replica of a model's pool: affinity (bounded-load consistent hashing), power of
two choices, round-robin.

Every balancer answers ``choose(pool, key, now, exclude)`` with an available backend (healthy,
not ejected, under its in-flight limit, not in ``exclude``) or None when there is none: the
caller then sheds the request at once (503 + Retry-After). ``exclude`` holds the backends a
request has already tried, so a hedge or a retry goes to another replica; ``copy`` says the
request is such a copy (see power of two choices below).

**Affinity** (`BoundedLoadHash`): consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, 2018). Each backend id is hashed to ``vnodes`` points of a 64-bit ring
(blake2b: stable across processes, unlike ``hash()`` with its per-process seed); a key is
hashed to a point and walks clockwise to the first backend that may take it. With n backends
in service carrying T requests in flight, a backend may take the request while

    in_flight + 1 <= ceil((1 + ε) · (T + 1) / n)

so none ever carries more than (1 + ε) times the mean (rounded up): a hot key spills over to
the next replicas on the ring instead of melting its own. Equal keys land on the same replica
while it is available and under the bound, so its cache stays warm. Ejected or unhealthy
backends stay on the ring and are only skipped, and removing a backend only removes its own
points: either way, only the keys that went to it move.

**Power of two choices** (`PowerOfTwo`): pick two available backends at random and send to the
one with the lower score

    score = (in_flight + 1) · latency

where latency is the backend's EWMA of reply latency (the median of the others' while it has
no sample yet): the expected time until a new request would be answered if it queued behind
the ones in flight. Two random choices, rather than the best of all, keep a burst of requests
from herding onto one momentarily best replica (Mitzenmacher, 2001). When the better of the
two is busy, up to two random *idle* replicas are weighed against it too, by the same score
(so an idle one wins unless its latency is more than the busy one's in-flight count plus one
times the busy one's): with a handful of replicas at moderate load, both picks are busy a few
percent of the time while another sits idle, and a request queued behind a batch there waits a
whole service time longer, which is what a healthy pool's p99 is made of (measured: four
replicas of a 5 ms model at a quarter of their capacity, p99 11.5 ms, twice the service time).
Idle ones are picked at random too, so several routers, each seeing only its own requests in
flight, do not all pile onto the same idle replica. A copy (a hedge or a
retry) goes to the best of all the others instead: it is there to beat an attempt that is
already late, and one that lands behind a batch on a busy replica adds that batch's time to
the request's tail (a hedge waiting there cost up to a whole service time more than one sent
to an idle replica). Copies are a few percent of requests, and each counts in flight at once,
so they do not herd.

A *suspect* replica, one whose requests lose to hedges far more often than its peers'
(`Pool.suspect`: it stalls now and then), has its score tripled (``SUSPECT_PENALTY``): it
takes a request only when the others have two or more ahead of it, as overflow. Its latency
average cannot say this on its own when hedging is on: a stalled request there loses to its
hedge and is withdrawn, so the replica's average learns only a lower bound (the time the
loser had run, a couple of service times; without hedging it would learn the whole stall,
twenty), and p2c would go on sending it nearly its full share, of which every twentieth
request is a stall answered only by its hedge, after the hedge delay and a second reply:
about 2.5 service times, against 2 for a request with one ahead on a healthy replica, and
with no stall odds. Like its latency average, the suspicion is not believed once the replica
has sent no reply for ``STALE_AFTER_S``: so it still gets a request every few seconds, and its
share lapses as it answers them first again (a replica that has healed comes back).

**Round-robin** (`RoundRobin`): the baseline; cycles through the pool's order, skipping what
is unavailable.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import statistics
from collections.abc import Collection, Iterator
from typing import Protocol

from tailserve.router.backends import Backend, Pool

# Points per backend: with 100, each backend's share of the keys stays within about ±20% of
# the mean (measured for pools of 4 to 30); fewer points spread keys more unevenly, and the
# bound then spills more of them away from their home.
DEFAULT_VNODES = 100
DEFAULT_EPSILON = 0.25
# How many distinct memberships a BoundedLoadHash keeps rings for (one per model pool, as a
# rule; the bound only stops a churn of memberships from growing it without limit).
_RING_CACHE = 64


class Balancer(Protocol):
    def choose(
        self,
        pool: Pool,
        key: str | None,
        now: float,
        exclude: Collection[Backend] = (),
        *,
        copy: bool = False,
    ) -> Backend | None: ...


def _candidates(pool: Pool, now: float, exclude: Collection[Backend]) -> list[Backend]:
    return [b for b in pool if b.is_available(now) and b not in exclude]


class RoundRobin:
    """The baseline: a copy takes its turn like any request."""

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        pool: Pool,
        key: str | None,
        now: float,
        exclude: Collection[Backend] = (),
        *,
        copy: bool = False,
    ) -> Backend | None:
        backends = pool.backends
        count = len(backends)
        for step in range(count):
            index = (self._next + step) % count
            backend = backends[index]
            if backend.is_available(now) and backend not in exclude:
                self._next = index + 1
                return backend
        return None


class PowerOfTwo:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def choose(
        self,
        pool: Pool,
        key: str | None,
        now: float,
        exclude: Collection[Backend] = (),
        *,
        copy: bool = False,
    ) -> Backend | None:
        candidates = _candidates(pool, now, exclude)
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        known = [b.latency_s for b in pool if b.latency_s is not None and not _stale(b, now)]
        # A backend with no (recent) sample is neither favoured nor shunned: it is taken to be
        # as fast as the pool's median (with no samples at all, the score is the load alone).
        prior = statistics.median(known) if known else 1.0
        bar = pool.suspicion_bar()

        def cost(backend: Backend) -> float:
            # Like a latency average, the suspicion is not believed once it is stale.
            suspect = backend.overtaken >= bar and not _stale(backend, now)
            return score(backend, prior, now) * (SUSPECT_PENALTY if suspect else 1.0)

        if copy:
            # Ties are broken at random, or every copy would go to the pool's first idle one.
            self._rng.shuffle(candidates)
            return min(candidates, key=cost)
        first, second = self._rng.sample(candidates, 2)
        first_score, second_score = cost(first), cost(second)
        best, best_score = (
            (first, first_score) if first_score <= second_score else (second, second_score)
        )
        if best.in_flight:
            idle = [b for b in candidates if not b.in_flight and b is not first and b is not second]
            for other in self._rng.sample(idle, min(2, len(idle))):
                other_score = cost(other)
                if other_score < best_score:
                    best, best_score = other, other_score
        return best


# A suspect replica's score is multiplied by this (see Pool.suspect): it is chosen over another
# only when that one has at least two requests ahead of a new one (a tie at two).
SUSPECT_PENALTY = 3.0

# A latency average with no new sample for this long is no longer believed (it falls back to
# the pool's median): otherwise a backend that once looked slower would never be chosen again
# while the load is light (nothing in flight to break the tie), and so never be measured anew.
STALE_AFTER_S = 2.0


def score(backend: Backend, prior_s: float, now: float | None = None) -> float:
    """Power of two choices' cost: the expected wait for a new request on this backend."""
    latency = backend.latency_s
    if latency is None or (now is not None and _stale(backend, now)):
        latency = prior_s
    return (backend.in_flight + 1) * latency


def _stale(backend: Backend, now: float) -> bool:
    return backend.sampled_at is not None and now - backend.sampled_at > STALE_AFTER_S


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and on every machine."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("owners", "points", "size")

    def __init__(self, ids: Collection[str], vnodes: int) -> None:
        placed = sorted(
            (stable_hash(f"{backend_id}#{i}"), backend_id)
            for backend_id in ids
            for i in range(vnodes)
        )
        self.points = [point for point, _ in placed]
        self.owners = [owner for _, owner in placed]
        self.size = len(set(ids))

    def walk(self, key: str) -> Iterator[str]:
        """The backend ids in the order a key meets them, clockwise from its point. Lazy: the
        first one usually takes the request, and a full walk visits every point."""
        start = bisect.bisect_right(self.points, stable_hash(key))
        seen: set[str] = set()
        count = len(self.owners)
        for step in range(count):
            owner = self.owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == self.size:
                    return


class BoundedLoadHash:
    def __init__(
        self,
        *,
        epsilon: float = DEFAULT_EPSILON,
        vnodes: int = DEFAULT_VNODES,
        fallback: Balancer | None = None,
    ) -> None:
        if epsilon <= 0:
            raise ValueError(f"epsilon must be positive, not {epsilon}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, not {vnodes}")
        self.epsilon = epsilon
        self.vnodes = vnodes
        # A request with no key has no affinity to keep: it is balanced on load instead.
        self._fallback = fallback if fallback is not None else PowerOfTwo()
        self._rings: dict[tuple[str, ...], _Ring] = {}

    def bound(self, pool: Pool, now: float) -> int:
        """The most requests any backend may carry once the next one is placed."""
        serving = pool.in_service(now)
        if not serving:
            return 0
        total = sum(b.in_flight for b in serving)
        # The small tolerance keeps an exact product (1.25 · 8 / 2 = 5) from rounding up to 6
        # through a floating-point error.
        return math.ceil((1 + self.epsilon) * (total + 1) / len(serving) - 1e-9)

    def order(self, pool: Pool, key: str) -> Iterator[Backend]:
        """The pool's backends in the order the key prefers them (its walk round the ring)."""
        for backend_id in self._ring(pool.ids).walk(key):
            backend = pool.get(backend_id)
            if backend is not None:
                yield backend

    def choose(
        self,
        pool: Pool,
        key: str | None,
        now: float,
        exclude: Collection[Backend] = (),
        *,
        copy: bool = False,
    ) -> Backend | None:
        # A keyed copy walks on round the ring like any request of its key (the next replica
        # is the one that warms up for the key when its own is out).
        if key is None:
            return self._fallback.choose(pool, key, now, exclude, copy=copy)
        bound = self.bound(pool, now)
        least: Backend | None = None
        for backend in self.order(pool, key):
            if not backend.is_available(now) or backend in exclude:
                continue
            if backend.in_flight + 1 <= bound:
                return backend
            if least is None or backend.in_flight < least.in_flight:
                least = backend
        # Only reachable when in-flight limits differ: saturated backends count in the mean
        # but cannot take more, so every open one may be over the bound. Serving from the
        # least loaded open one beats shedding a request some replica has room for.
        return least

    def _ring(self, ids: tuple[str, ...]) -> _Ring:
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= _RING_CACHE:
                self._rings.pop(next(iter(self._rings)))
            ring = self._rings[ids] = _Ring(ids, self.vnodes)
        return ring


BALANCERS = ("affinity", "p2c", "round-robin")


def make_balancer(
    name: str, *, rng: random.Random | None = None, epsilon: float = DEFAULT_EPSILON
) -> Balancer:
    """The balancer a model's configuration names: ``affinity``, ``p2c`` or ``round-robin``."""
    if name == "affinity":
        return BoundedLoadHash(epsilon=epsilon, fallback=PowerOfTwo(rng))
    if name == "p2c":
        return PowerOfTwo(rng)
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown balancer {name!r}: expected one of {', '.join(BALANCERS)}")
