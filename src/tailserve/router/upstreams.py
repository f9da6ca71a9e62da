"""The dispatcher's registry of backends: one `Upstream` (routing state and connection pool)
for each member, and the pool of replicas each model is sent to.

Membership comes in whole (`set_members`: command line, a watched file, DNS; membership.py).
A new backend starts out of service until its first readiness check passes; one that leaves
takes no new requests and is closed once nothing is in flight to it (`settle`). A model's pool
holds the backends whose model index lists it READY, or every backend (`ANY`'s pool) while
none does, so a request for an unknown model gets a worker's own 404. Pools are built on
demand and dropped whenever the membership or an index changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, ValuesView

from tailserve.router.backends import Backend, Pool
from tailserve.router.config import RouterConfig, parse_backend
from tailserve.transport.base import ClientPool, Connect

log = logging.getLogger(__name__)

# The pool of every backend: non-model routes, and models no backend has listed yet.
ANY = "*"


class Upstream:
    """One backend: its routing state and its connection pool."""

    __slots__ = ("backend", "leaving", "models", "pool")

    def __init__(self, backend: Backend, pool: ClientPool) -> None:
        self.backend = backend
        self.pool = pool
        # The models it has READY, from its index; None until known (then it serves all).
        self.models: frozenset[str] | None = None
        self.leaving = False


class Upstreams:
    """The current members, looked up by URL as in a read-only dict; those still draining
    after they left; and the pools of replicas per model."""

    def __init__(
        self, config: RouterConfig, *, connect: Connect, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._config = config
        # How a backend's connection pool is made (transport/base.py: real or in-process).
        self._connect = connect
        self._loop = loop
        self._members: dict[str, Upstream] = {}
        self._leaving: dict[str, Upstream] = {}
        self._everyone = Pool(ANY)
        self._pools: dict[str, Pool] = {}
        self._known: frozenset[str] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    # --- the members by URL ---------------------------------------------------------------

    def __getitem__(self, url: str) -> Upstream:
        return self._members[url]

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, url: object) -> bool:
        return url in self._members

    def get(self, url: str) -> Upstream | None:
        return self._members.get(url)

    def values(self) -> ValuesView[Upstream]:
        return self._members.values()

    @property
    def backends(self) -> list[Backend]:
        return [u.backend for u in self._members.values()]

    @property
    def everyone(self) -> Pool:
        """The pool of every member (`ANY`)."""
        return self._everyone

    # --- membership -----------------------------------------------------------------------

    def set_members(self, urls: Iterable[str], *, healthy: bool = False) -> None:
        """Make the backends exactly these URLs. New ones start out of service until their
        first readiness check passes (unless ``healthy``); ones that left get no new requests
        and are closed once what they have in flight is done."""
        wanted = list(dict.fromkeys(urls))
        config = self._config
        for url in wanted:
            if url in self._members:
                continue
            host, port = parse_backend(url)
            backend = Backend(url, url, max_in_flight=config.max_in_flight, healthy=healthy)
            pool = self._connect(
                host, port, max_connections=config.max_connections, loop=self._loop
            )
            self._members[url] = Upstream(backend, pool)
            self._everyone.add(backend)
            self._leaving.pop(url, None)
            log.info("backend %s joined", url)
        staying = set(wanted)
        for url in [u for u in self._members if u not in staying]:
            upstream = self._members.pop(url)
            upstream.leaving = True
            self._everyone.remove(url)
            self._leaving[url] = upstream
            log.info("backend %s left: draining %d in flight", url, upstream.backend.in_flight)
            self.settle(upstream)
        self._changed()

    def settle(self, upstream: Upstream) -> None:
        """Close a departed backend's connections once nothing is in flight to it."""
        if (
            upstream.leaving
            and upstream.backend.in_flight == 0
            and self._leaving.pop(upstream.backend.id, None) is not None
        ):
            task = self._loop.create_task(upstream.pool.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def set_models(self, upstream: Upstream, models: frozenset[str]) -> None:
        """What ``upstream``'s model index lists READY now."""
        if models != upstream.models:
            upstream.models = models
            self._changed()

    def _changed(self) -> None:
        self._pools.clear()
        self._known = None

    # --- pools ----------------------------------------------------------------------------

    def pool_for(self, model: str) -> Pool:
        if model == ANY:
            return self._everyone
        pool = self._pools.get(model)
        if pool is None:
            members = [
                u.backend for u in self._members.values() if u.models is None or model in u.models
            ]
            # No backend lists it: every backend, so the request gets a worker's own answer
            # (404 for an unknown model, 503 for one still loading).
            pool = Pool(model, members) if members else self._everyone
            self._pools[model] = pool
        return pool

    def known_models(self) -> frozenset[str]:
        """Every model some backend lists READY (kept until the membership or an index
        changes)."""
        known = self._known
        if known is None:
            known = self._known = frozenset().union(
                *(u.models for u in self._members.values() if u.models is not None)
            )
        return known

    async def close(self) -> None:
        """Close every connection pool, the members' and the departed ones'."""
        pools = [u.pool for u in (*self._members.values(), *self._leaving.values())]
        await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)
