"""The router's view of its workers: one `Backend` per replica, one `Pool` per model.

A backend's state is what the policies decide on: requests in flight (and its limit), an
exponentially weighted moving average (EWMA) of its reply latency, consecutive failures, the
verdict of the active health checks (``GET /v2/health/ready``) and of outlier ejection.

A backend is *in service* while it is healthy and not ejected, and *available* while it is in
service and under its in-flight limit. When no backend of a pool is available the balancers
answer None and the caller sheds the request at once (503 + Retry-After) rather than queue it:
backpressure stays explicit.

Pure: nothing here reads a clock; times are passed in (seconds, any monotonic origin).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# The weight of one request in a backend's share of requests overtaken by a hedge: 0.02
# remembers about the last fifty, enough to tell 5% from 1% without waiting long for it.
OVERTAKEN_ALPHA = 0.02
# A replica is suspect when at least this share of its requests lose to hedges...
SUSPECT_SHARE = 0.02
# ...and this many times the pool's median share.
SUSPECT_FACTOR = 3.0
# The counts outlier ejection judges a replica's losses to hedges on (see health.py) are
# halved once its first copies reach this many: they speak of its last few hundred requests.
OVERTAKEN_WINDOW = 200


@dataclass(slots=True, eq=False)
class Backend:
    """One replica. ``id`` is its stable name (the affinity ring hashes it, so it must not
    change when the router restarts); ``url`` is where requests go (the id when not given).

    Compared by identity: two replicas with the same counters are still two replicas.
    """

    id: str
    url: str = ""
    max_in_flight: int = 64
    in_flight: int = 0
    # EWMA of the reply latency in seconds; None until the first sample.
    latency_s: float | None = None
    samples: int = 0
    # The same average over its successful replies alone: how long a request there usually
    # takes (a failure's or a refusal's time may raise latency_s, never this).
    usual_s: float | None = None
    # When the last latency sample came (None: never, or the caller passes no times).
    sampled_at: float | None = None
    consecutive_failures: int = 0
    # When it last failed (an error, a timeout, a failed connect; None: not since it came).
    failed_at: float | None = None
    # Set by the active health checks (the proxy may start a backend unhealthy until its
    # first check passes; the policies default to trusting it).
    healthy: bool = True
    # Outlier ejection (see health.py): ejected while now < ejected_until. It stays set after
    # it expires until the detector notes the re-admission (readmitted_at).
    ejected_until: float | None = None
    ejections: int = 0
    readmitted_at: float | None = None
    # The share of its first copies that a hedge sent elsewhere beat (an average over recent
    # requests: see Pool.overtaken). A healthy replica's tail seldom loses to a copy sent at
    # the p95; a replica that stalls loses most of its stalled requests.
    overtaken: float = 0.0
    # The same as counts, for outlier ejection: its first copies and those a hedge beat, over
    # its last OVERTAKEN_WINDOW to twice that many requests (forgotten on ejection).
    first_copies: int = 0
    first_losses: int = 0

    def __post_init__(self) -> None:
        if not self.url:
            self.url = self.id
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {self.max_in_flight}")

    def is_ejected(self, now: float) -> bool:
        return self.ejected_until is not None and now < self.ejected_until

    def in_service(self, now: float) -> bool:
        return self.healthy and not self.is_ejected(now)

    @property
    def saturated(self) -> bool:
        return self.in_flight >= self.max_in_flight

    def is_available(self, now: float) -> bool:
        return self.in_service(now) and not self.saturated

    def reset_stats(self) -> None:
        """Forget the latency average, the failure streak and the losses to hedges (on
        ejection). The average share overtaken stays: a replica back from an ejection for its
        losses is still suspect (its late requests are hedged at their delay) until it
        shows otherwise."""
        self.latency_s = None
        self.usual_s = None
        self.samples = 0
        self.sampled_at = None
        self.consecutive_failures = 0
        self.first_copies = 0
        self.first_losses = 0


class Pool:
    """The replicas that serve one model, in a stable order (round-robin cycles through it).

    The proxy marks each attempt: `start` when it sends, then exactly one of `finish` (a reply,
    or a timeout or server error with ``ok=False``), `refused` (a 429), `connect_failed` or
    `cancelled` (the losing copy of a hedged request).
    """

    def __init__(
        self, model: str, backends: Iterable[Backend] = (), *, ewma_alpha: float = 0.2
    ) -> None:
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], not {ewma_alpha}")
        self.model = model
        # The weight of each new latency sample in the average: 0.2 forgets a sample's
        # influence to ~1% in 20 replies, fast enough to see a replica slow down within a
        # second at the rates a router sees, slow enough that one outlier does not swing it.
        self.ewma_alpha = ewma_alpha
        self._backends: dict[str, Backend] = {}
        for backend in backends:
            self.add(backend)

    # --- membership -----------------------------------------------------------------------

    def add(self, backend: Backend) -> None:
        if backend.id in self._backends:
            raise ValueError(f"backend {backend.id!r} is already in the pool of {self.model!r}")
        self._backends[backend.id] = backend

    def remove(self, backend_id: str) -> Backend | None:
        return self._backends.pop(backend_id, None)

    def get(self, backend_id: str) -> Backend | None:
        return self._backends.get(backend_id)

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._backends.values())

    def __len__(self) -> int:
        return len(self._backends)

    def __contains__(self, backend: object) -> bool:
        return isinstance(backend, Backend) and self._backends.get(backend.id) is backend

    # --- queries --------------------------------------------------------------------------

    def available(self, now: float) -> list[Backend]:
        """The backends a request may go to now: healthy, not ejected, under their limit."""
        return [b for b in self._backends.values() if b.is_available(now)]

    def in_service(self, now: float) -> list[Backend]:
        """The healthy, not ejected backends, saturated or not."""
        return [b for b in self._backends.values() if b.in_service(now)]

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for b in self._backends.values())

    def ejected(self, now: float) -> list[Backend]:
        return [b for b in self._backends.values() if b.is_ejected(now)]

    # --- one attempt's life ---------------------------------------------------------------

    def start(self, backend: Backend) -> None:
        backend.in_flight += 1

    def finish(
        self, backend: Backend, latency_s: float, *, ok: bool, now: float | None = None
    ) -> None:
        """A reply came (``ok``), or the attempt timed out or the backend answered with a
        server error (not ``ok``: the proxy decides which statuses count; a client's 4xx is
        the client's fault, not the backend's)."""
        self._done(backend)
        if now is not None:
            backend.sampled_at = now
        if ok:
            backend.consecutive_failures = 0
            self._sample(backend, latency_s)
            backend.usual_s = self._moved(backend.usual_s, latency_s)
        else:
            backend.consecutive_failures += 1
            if now is not None:
                backend.failed_at = now
            # A failure may only make a backend look slower: a replica that fails fast must not
            # look like the fastest one and draw more traffic (the "black hole").
            if backend.latency_s is not None and latency_s > backend.latency_s:
                self._sample(backend, latency_s)

    def refused(self, backend: Backend, latency_s: float, *, now: float | None = None) -> None:
        """The backend answered 429: too busy for the request. No failure (it sheds as it
        should) and no sign of speed either: like a failure's, its latency may only raise the
        average, or a replica refusing in a millisecond would look the fastest and draw still
        more of the traffic it is refusing."""
        self.inconclusive(backend, latency_s, now=now)

    def inconclusive(self, backend: Backend, latency_s: float, *, now: float | None = None) -> None:
        """An attempt that says nothing of the backend's health: a 429 (`refused`), a 503
        about one model (not loaded, its feature store down), or a timeout that came before
        the backend could have answered (a request's own deadline shorter than its usual
        reply time). Not a failure, or a client could get healthy replicas ejected; its
        latency may only raise the average, as a refusal's."""
        self._done(backend)
        if now is not None:
            backend.sampled_at = now
        if backend.latency_s is not None and latency_s > backend.latency_s:
            self._sample(backend, latency_s)

    def connect_failed(self, backend: Backend, *, now: float | None = None) -> None:
        self._done(backend)
        backend.consecutive_failures += 1
        if now is not None:
            backend.failed_at = now

    def overtaken(self, backend: Backend, lost: bool) -> None:
        """A request's first copy to ``backend`` ended: it answered first (``lost`` False) or a
        hedge sent elsewhere answered before it (True)."""
        backend.overtaken += OVERTAKEN_ALPHA * (float(lost) - backend.overtaken)
        backend.first_copies += 1
        backend.first_losses += lost
        if backend.first_copies >= OVERTAKEN_WINDOW:
            backend.first_copies //= 2
            backend.first_losses //= 2

    def suspect(self, backend: Backend) -> bool:
        """Whether ``backend`` loses to hedges far more often than its peers: at least
        ``SUSPECT_SHARE`` of its recent requests, and ``SUSPECT_FACTOR`` times the pool's
        median. Its requests that are late are likely stuck, not a healthy tail."""
        return backend.overtaken >= self.suspicion_bar()

    def suspicion_bar(self) -> float:
        """The share of requests overtaken at which a replica of this pool is suspect: at
        least ``SUSPECT_SHARE``, and ``SUSPECT_FACTOR`` times the pool's median share (one
        sort, for callers that judge several replicas at once)."""
        shares = sorted(b.overtaken for b in self._backends.values())
        median = shares[(len(shares) - 1) // 2] if shares else 0.0
        return max(SUSPECT_SHARE, SUSPECT_FACTOR * median)

    def cancelled(self, backend: Backend, lost_after_s: float | None = None) -> None:
        """A copy withdrawn: the client went, or (``lost_after_s`` given) another copy answered
        first after this one had run that long. A loser's latency is only known to be longer
        than that: it adds a sample when that bound is above the backend's average, and never
        a failure. Without it, a replica whose stalled requests all lose to hedges keeps the
        average of its fast replies, and p2c keeps sending it its full share."""
        self._done(backend)
        if lost_after_s is not None and (
            backend.latency_s is None or lost_after_s > backend.latency_s
        ):
            self._sample(backend, lost_after_s)

    def _done(self, backend: Backend) -> None:
        if backend.in_flight <= 0:
            raise ValueError(f"backend {backend.id!r} has no request in flight")
        backend.in_flight -= 1

    def _sample(self, backend: Backend, latency_s: float) -> None:
        backend.latency_s = self._moved(backend.latency_s, latency_s)
        backend.samples += 1

    def _moved(self, average: float | None, sample: float) -> float:
        """An EWMA after one more sample (the sample itself when there was none)."""
        return sample if average is None else average + self.ewma_alpha * (sample - average)
