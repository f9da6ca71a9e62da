"""The result cache as a request sees it: L1, then L2, then one computation for all who ask.

``ResultCache.serve(view, key, mode, compute)`` answers a request from the first tier that has a
fresh result, else runs ``compute`` once for every identical request in flight (single flight),
stores what it computed in both tiers, and says where the answer came from (``source``):

- ``l1`` / ``l2``: a fresh hit; ``precomputed``: a hit written by a precompute job;
- ``stale``: past its TTL, within the grace window: served at once and refreshed in the
  background, once however many requests see it stale; or, while the model is overloaded
  (``pressed``), up to ``overload_s`` past its TTL: served instead of computed, and not
  refreshed (the model has no time for it; the next request after the overload computes);
- ``coalesced``: waited for an identical request in flight (here, or on another worker that held
  the Redis lease);
- ``miss``: computed; ``bypass`` / ``refresh``: the request asked not to read the cache (refresh
  still writes the new result).

Invalidation (by model, version or key prefix) drops matching entries from this worker's L1
and from Redis, and is published so every other worker's L1 drops them too; a result that was
being computed while an invalidation passed is not stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

from tailserve.cache import entry as codec
from tailserve.cache.entry import CachedResult, Lineage, Outputs
from tailserve.cache.invalidations import InvalidationFeed
from tailserve.cache.keys import PREFIX, KeyBuilder
from tailserve.cache.memory import Lookup, MemoryCache
from tailserve.cache.redis import INVALIDATION_CHANNEL
from tailserve.cache.tier import CacheTier
from tailserve.errors import DeadlineExceeded, DeadlineUnmeetable, Overloaded

log = logging.getLogger(__name__)

Mode = Literal["use", "bypass", "refresh"]
MODES = ("use", "bypass", "refresh")


class CacheObserver(Protocol):
    def on_lookup(self, model: str, tier: str, result: str) -> None: ...
    def on_compute(self, model: str, recompute: bool) -> None: ...
    def on_coalesced(self, model: str) -> None: ...
    def on_evict(self, model: str, size: int) -> None: ...


class _NoObserver:
    def on_lookup(self, model: str, tier: str, result: str) -> None:
        pass

    def on_compute(self, model: str, recompute: bool) -> None:
        pass

    def on_coalesced(self, model: str) -> None:
        pass

    def on_evict(self, model: str, size: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """One model's freshness and coalescing settings (from model.yaml's ``cache``)."""

    l1_ttl_s: float = 300.0
    l2_ttl_s: float = 300.0
    grace_s: float = 0.0
    # Under overload, a value this long past its TTL is still served (stale-if-overloaded).
    overload_s: float = 0.0
    use_l2: bool = True
    lease_s: float = 0.0  # > 0: coalesce across workers through a Redis lease this long
    feature_version: str = ""

    @property
    def keep_s(self) -> float:
        """How long past its TTL a value is kept: for the grace window, or for overload."""
        return max(self.grace_s, self.overload_s)


_SERIALS = itertools.count(1)


@dataclass(slots=True)
class ModelView:
    """One served version of one model, as the cache sees it."""

    model: str
    version: int
    keys: KeyBuilder
    l1: MemoryCache
    policy: CachePolicy
    # Tells this view from any other, now or later (the reply memo names views by it).
    serial: int = field(default_factory=lambda: next(_SERIALS))


@dataclass(slots=True)
class Served:
    outputs: Outputs
    source: str
    lineage: Lineage | None
    # What `compute` returned beside the outputs (the batch's account) when this request ran it.
    extra: Any = None
    # A fresh L1 hit's stored bytes (what the entry was, to tell it from a later one).
    value: bytes | None = None


class _LeaderGone(Exception):
    """The request computing a shared result was cancelled, or refused for reasons of its
    own; its followers compute themselves."""


# Refusals that speak of the leading request, not of the input: its deadline could not be
# met, or its priority found the queue full. A follower may have more time or a higher
# priority, so it tries for itself (the first to wake leads the rest) rather than get the
# leader's 429.
_OWN_REFUSALS = (Overloaded, DeadlineUnmeetable, DeadlineExceeded)


Compute = Callable[[], Awaitable[tuple[Outputs, Any]]]
# Whether the model is overloaded now (asked only of a value past its grace window).
Pressed = Callable[[], bool]


def _never() -> bool:
    return False


class ResultCache:
    def __init__(
        self,
        *,
        redis: CacheTier | None = None,
        worker_id: str = "",
        observer: CacheObserver | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.observer: CacheObserver = observer or _NoObserver()
        self._wall = wall_clock
        self._inflight: dict[str, asyncio.Future[Served]] = {}
        self._refreshing: set[str] = set()
        self._l1s: dict[str, MemoryCache] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Bumped by an invalidation: a result computed across one is not stored. Per model
        # (a prefix names one: ``ts:{model}:``), so invalidating one model does not throw
        # away what the others are computing; the global one for what names none.
        self._generation = 0
        self._model_generations: dict[str, int] = {}
        self._feed: InvalidationFeed | None = None
        self._never = asyncio.Event()
        self._heard = False  # subscribed once already: a later subscription follows a gap

    def l1_for(self, model: str, make: Callable[[], MemoryCache]) -> MemoryCache:
        """The model's L1 namespace, shared by its versions (their keys differ)."""
        found = self._l1s.get(model)
        if found is None:
            found = self._l1s[model] = make()
        return found

    def evicted(self, model: str) -> Callable[[int], None]:
        observer = self.observer
        return lambda size: observer.on_evict(model, size)

    def l1s(self) -> dict[str, MemoryCache]:
        return dict(self._l1s)

    # --- serving ----------------------------------------------------------------------------

    async def serve(
        self,
        view: ModelView,
        key: str,
        mode: Mode,
        compute: Compute,
        pressed: Pressed = _never,
    ) -> Served:
        if mode == "bypass":
            outputs, extra = await compute()
            return Served(outputs, "bypass", None, extra)
        if mode == "refresh":
            return await self._compute(view, key, compute, "refresh", recompute=True)
        model = view.model
        lookup, found = view.l1.get(key)
        if found is not None:
            # L1 holds the encoded bytes: untracked by the collector, and the decode (~3 µs)
            # gives each hit arrays of its own.
            result = codec.decode(found[0])
            if lookup is Lookup.STALE:
                overdue = view.l1.now() - found[2]
                if overdue < view.policy.grace_s:
                    self.observer.on_lookup(model, "l1", "stale")
                    self._refresh_later(view, key, compute, from_l2=True)
                    return Served(result.outputs, "stale", result.lineage)
                if pressed():
                    self.observer.on_lookup(model, "l1", "stale_overloaded")
                    return Served(result.outputs, "stale", result.lineage)
                lookup = Lookup.EXPIRED  # kept only for an overload: computed afresh
            else:
                self.observer.on_lookup(model, "l1", lookup.value)
                source = "precomputed" if result.lineage.precomputed else "l1"
                return Served(result.outputs, source, result.lineage, value=found[0])
        self.observer.on_lookup(model, "l1", lookup.value)
        waiting = self._inflight.get(key)
        if waiting is not None:
            return await self._follow(view, key, waiting, compute)
        future: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            served = await self._lead(view, key, compute, lookup, pressed)
        except BaseException as exc:
            own = isinstance(exc, (asyncio.CancelledError, *_OWN_REFUSALS))
            future.set_exception(_LeaderGone() if own else exc)
            future.exception()  # retrieved: no "never retrieved" warning when none follow
            raise
        else:
            future.set_result(served)
        finally:
            if self._inflight.get(key) is future:
                del self._inflight[key]
        return served

    async def _follow(
        self, view: ModelView, key: str, waiting: asyncio.Future[Served], compute: Compute
    ) -> Served:
        self.observer.on_coalesced(view.model)
        try:
            led = await asyncio.shield(waiting)
        except _LeaderGone:
            return await self.serve(view, key, "use", compute)
        return Served(led.outputs, "coalesced", led.lineage)

    async def _lead(
        self, view: ModelView, key: str, compute: Compute, lookup: Lookup, pressed: Pressed
    ) -> Served:
        redis = self.redis if view.policy.use_l2 else None
        leased = False
        if redis is not None:
            hit = await self._from_l2(view, key, compute, redis, pressed)
            if hit is not None:
                return hit
            if view.policy.lease_s > 0:
                taken = await redis.lease(key, self.worker_id, view.policy.lease_s)
                if taken is False:
                    waited = await self._await_other_worker(view, key, redis)
                    if waited is not None:
                        return waited
                leased = taken is True
        recompute = lookup in (Lookup.EXPIRED, Lookup.EVICTED)
        try:
            return await self._compute(view, key, compute, "miss", recompute=recompute)
        except BaseException:
            if leased and redis is not None:
                # No result is coming from here: the workers waiting on the lease may take it
                # now rather than wait it out.
                redis.release_lease(key, self.worker_id)
            raise

    async def _from_l2(
        self, view: ModelView, key: str, compute: Compute, redis: CacheTier, pressed: Pressed
    ) -> Served | None:
        result = await self._read_l2(view, key, redis)
        if result is None:
            self.observer.on_lookup(view.model, "l2", "miss")
            return None
        overdue = self._wall() - result.fresh_until
        if overdue < 0:
            self.observer.on_lookup(view.model, "l2", "hit")
            source = "precomputed" if result.lineage.precomputed else "l2"
            return Served(result.outputs, source, result.lineage)
        if overdue < view.policy.grace_s:
            self.observer.on_lookup(view.model, "l2", "stale")
            self._refresh_later(view, key, compute)
            return Served(result.outputs, "stale", result.lineage)
        if overdue < view.policy.overload_s and pressed():
            self.observer.on_lookup(view.model, "l2", "stale_overloaded")
            return Served(result.outputs, "stale", result.lineage)
        self.observer.on_lookup(view.model, "l2", "expired")
        return None

    async def _read_l2(self, view: ModelView, key: str, redis: CacheTier) -> CachedResult | None:
        """The value under ``key`` in Redis (None: none, or undecodable), filling L1 with it
        while it is fresh, for what is left of its life (its TTL in L1 is no longer than
        L2's)."""
        raw = await redis.get(key)
        if raw is None:
            return None
        try:
            result = codec.decode(raw)
        except ValueError:
            log.warning("dropping an undecodable L2 value under %s", key)
            return None
        left = result.fresh_until - self._wall()
        if left > 0:
            policy = view.policy
            view.l1.put(key, raw, len(raw), min(left, policy.l1_ttl_s), policy.keep_s)
        return result

    async def _await_other_worker(
        self, view: ModelView, key: str, redis: CacheTier
    ) -> Served | None:
        """Another worker holds the lease: poll L2 for its result until the lease runs out."""
        loop = asyncio.get_running_loop()
        until = loop.time() + view.policy.lease_s
        pause = 0.001
        while loop.time() < until:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.01)
            raw = await redis.get(key)
            if raw is not None:
                with contextlib.suppress(ValueError):
                    result = codec.decode(raw)
                    self.observer.on_coalesced(view.model)
                    policy = view.policy
                    view.l1.put(key, raw, len(raw), policy.l1_ttl_s, policy.keep_s)
                    return Served(result.outputs, "coalesced", result.lineage)
        return None

    async def _compute(
        self, view: ModelView, key: str, compute: Compute, source: str, *, recompute: bool
    ) -> Served:
        generation = self._stamp(view.model)
        outputs, extra = await compute()
        self.observer.on_compute(view.model, recompute)
        policy = view.policy
        # (The batch's account names the variant that computed it, for a model with several.)
        variant = getattr(extra, "variant", "")
        lineage = Lineage(
            view.version, policy.feature_version, self._wall(), self.worker_id, variant=variant
        )
        if generation == self._stamp(view.model):  # no invalidation passed while it ran
            self.store(view, key, outputs, lineage)
        return Served(outputs, source, lineage, extra)

    def store(self, view: ModelView, key: str, outputs: Outputs, lineage: Lineage) -> None:
        policy = view.policy
        raw = codec.encode(CachedResult(outputs, lineage, lineage.computed_at + policy.l2_ttl_s))
        view.l1.put(key, raw, len(raw), policy.l1_ttl_s, policy.keep_s)
        if self.redis is not None and policy.use_l2:
            self.redis.put(key, raw, policy.l2_ttl_s + policy.keep_s)

    def _refresh_later(
        self, view: ModelView, key: str, compute: Compute, *, from_l2: bool = False
    ) -> None:
        """Refresh a stale entry in the background, once however many requests meet it.
        ``from_l2``: an L1 entry went stale; Redis, whose TTL may be longer, or which another
        worker may have refreshed already, is asked first, and the model runs only if it has
        nothing fresh."""
        if key in self._refreshing:
            return
        self._refreshing.add(key)
        redis = self.redis if from_l2 and view.policy.use_l2 else None

        async def refresh() -> None:
            try:
                if redis is not None and await self._fresh_from_l2(view, key, redis):
                    return
                await self._compute(view, key, compute, "refresh", recompute=True)
            except Exception as exc:  # the stale value keeps serving until its grace ends
                log.debug("background refresh of %s failed: %s", key, exc)
            finally:
                self._refreshing.discard(key)

        self._own(refresh())

    async def _fresh_from_l2(self, view: ModelView, key: str, redis: CacheTier) -> bool:
        """Fill L1 from a fresh value in Redis, if there is one."""
        result = await self._read_l2(view, key, redis)
        if result is None or result.fresh_until <= self._wall():
            return False
        self.observer.on_lookup(view.model, "l2", "hit")
        return True

    # --- invalidation -----------------------------------------------------------------------

    async def invalidate(self, prefix: str) -> dict[str, int | bool]:
        """Drop every result under ``prefix`` here, in Redis, and (by pub/sub) on every other
        worker. Redis being down does not stop the local part; the answer says what happened."""
        dropped_l1 = self.drop_local(prefix)
        report: dict[str, int | bool] = {"l1": dropped_l1, "l2": 0, "published": False}
        if self.redis is not None:
            # Redis first, then the others' L1s: told first, they would miss and refill from
            # the old values still in Redis. Each step is tried whatever became of the other.
            try:
                report["l2"] = await self.redis.drop_prefix(prefix)
            except Exception as exc:
                log.warning("invalidation of %r could not clear Redis: %s", prefix, exc)
            try:
                message = orjson.dumps({"prefix": prefix, "origin": self.worker_id})
                await self.redis.publish(INVALIDATION_CHANNEL, message)
                report["published"] = True
            except Exception as exc:
                log.warning("invalidation of %r reached only this worker: %s", prefix, exc)
        return report

    def drop_local(self, prefix: str) -> int:
        """Drop this worker's results under ``prefix``: its L1 entries, its writes to Redis
        not yet sent, and (by the generation) whatever it is computing now."""
        model = _model_of(prefix)
        if model is None:
            self._generation += 1
        else:
            self._model_generations[model] = self._model_generations.get(model, 0) + 1
        if self.redis is not None:
            self.redis.forget_writes(prefix)
        return sum(l1.drop_prefix(prefix) for l1 in self._l1s.values())

    def _stamp(self, model: str) -> tuple[int, int]:
        return self._generation, self._model_generations.get(model, 0)

    def start_listening(self, client_factory: Callable[[], Any]) -> None:
        """Follow invalidations published by other workers (reconnecting on its own)."""
        self._feed = InvalidationFeed(
            client_factory,
            self.drop_local,
            self._resubscribed,
            ignore_origin=self.worker_id,
            name="cache-invalidation",
        )
        self._feed.start()

    @property
    def subscribed(self) -> asyncio.Event:
        """Set while this worker hears the others' invalidations."""
        return self._feed.subscribed if self._feed is not None else self._never

    @property
    def invalidations_received(self) -> int:
        return self._feed.received if self._feed is not None else 0

    def _resubscribed(self) -> None:
        if self._heard:
            # Invalidations sent while we were away are lost: start L1 afresh.
            dropped = sum(l1.clear() for l1 in self._l1s.values())
            self._generation += 1
            log.info("invalidation channel back; dropped %d L1 entries", dropped)
        self._heard = True

    # --- housekeeping -----------------------------------------------------------------------

    def _own(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Wait for the refreshes running in the background, then for the shared tier's
        writes: what this worker knows is then in L2 for the others."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.redis is not None:
            await self.redis.flush()

    async def close(self) -> None:
        if self._feed is not None:
            await self._feed.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.redis is not None:
            await self.redis.close()


def _model_of(prefix: str) -> str | None:
    """The model a key prefix is within (``ts:{model}:...``), or None for a wider one."""
    head = f"{PREFIX}:{{"
    if not prefix.startswith(head):
        return None
    end = prefix.find("}", len(head))
    return prefix[len(head) : end] if end > 0 else None
