"""The result cache across workers that share L2: each test runs two workers' caches (two
`ResultCache`s, a tier each) on one store, a real redis-server and the in-process twin."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from support.l2 import MemoryStore, RedisStore, Store
from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.keys import KeyBuilder
from tailserve.cache.memory import MemoryCache
from tailserve.cache.tier import CacheTier
from tailserve.cache.tiered import CachePolicy, ModelView, ResultCache


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Model:
    """A computation that counts its runs and can be held until released."""

    def __init__(self) -> None:
        self.runs = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self) -> tuple[dict[str, Any], None]:
        self.runs += 1
        self.started.set()
        await self.release.wait()
        return {"y": np.array([float(self.runs)], dtype=np.float32)}, None


class Worker:
    """One worker's side of the cache: its L1, its tier on the shared store."""

    def __init__(self, name: str, tier: CacheTier, model: str, policy: CachePolicy) -> None:
        self.tier = tier
        self.clock = Clock(1000.0)
        self.cache = ResultCache(redis=tier, worker_id=name, wall_clock=self.clock)
        l1 = MemoryCache(max_entries=100, max_bytes=100_000, clock=self.clock)
        keys = KeyBuilder(model, 1, "schema")
        self.view = ModelView(model, 1, keys, self.cache.l1_for(model, lambda: l1), policy)
        self.model = Model()

    async def serve(self, key: str) -> tuple[str, float]:
        served = await self.cache.serve(self.view, key, "use", self.model)
        return served.source, float(served.outputs["y"][0])


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        found: Store = MemoryStore()
    else:
        found = RedisStore("redis-py", request.getfixturevalue("redis").url)
    yield found
    await found.close()


@pytest.fixture
def prefix() -> str:
    """A model of the test's own (the session's Redis is shared)."""
    return f"ts:{{m-{uuid.uuid4().hex[:12]}}}:"


@pytest.fixture
async def pair(store: Store, prefix: str) -> AsyncIterator[tuple[Worker, Worker]]:
    model = prefix[4:-2]
    policy = CachePolicy(l1_ttl_s=5, l2_ttl_s=60, grace_s=30, lease_s=5.0)
    workers = []
    for name in ("a", "b"):
        tier = store.tier(budget_s=1.0)
        assert await tier.connect()
        workers.append(Worker(name, tier, model, policy))
    yield workers[0], workers[1]
    for worker in workers:
        await worker.cache.close()


async def test_a_result_one_worker_computed_is_the_others_l2_hit_then_l1(
    pair: tuple[Worker, Worker], prefix: str
) -> None:
    a, b = pair
    key = prefix + "v1:k"
    assert await a.serve(key) == ("miss", 1.0)
    await a.tier.flush()
    assert await b.serve(key) == ("l2", 1.0)
    assert await b.serve(key) == ("l1", 1.0)
    assert (a.model.runs, b.model.runs) == (1, 0)


async def test_a_lease_makes_the_other_worker_wait_for_the_result_not_compute_it(
    pair: tuple[Worker, Worker], prefix: str
) -> None:
    a, b = pair
    key = prefix + "v1:k"
    a.model.release.clear()
    leading = asyncio.ensure_future(a.serve(key))
    await asyncio.wait_for(a.model.started.wait(), 5)  # a holds the lease now
    following = asyncio.ensure_future(b.serve(key))
    a.model.release.set()
    assert await leading == ("miss", 1.0)
    assert await following == ("coalesced", 1.0)
    assert (a.model.runs, b.model.runs) == (1, 0)


async def test_a_leader_that_fails_gives_its_lease_back_and_one_that_succeeds_keeps_it(
    pair: tuple[Worker, Worker], prefix: str
) -> None:
    a, b = pair

    async def failing() -> tuple[dict[str, Any], None]:
        raise ValueError("model failed")

    with pytest.raises(ValueError):
        await a.cache.serve(a.view, prefix + "v1:k", "use", failing)
    await a.tier.flush()
    # b may lead at once, not in 5 s: no result is coming from a.
    assert await b.tier.lease(prefix + "v1:k", "b", ttl_s=5.0) is True
    assert await a.serve(prefix + "v1:k2") == ("miss", 1.0)
    await a.tier.flush()
    assert await b.tier.lease(prefix + "v1:k2", "b", ttl_s=5.0) is False


async def test_a_stale_l1_entry_is_refreshed_from_a_fresh_l2_value_without_the_model(
    pair: tuple[Worker, Worker], prefix: str
) -> None:
    # L1 keeps a result 5 s, L2 60 s: once a's L1 copy is stale, the background refresh finds
    # L2's still fresh (here b's, computed later) and runs no model.
    a, b = pair
    key = prefix + "v1:k"
    assert await a.serve(key) == ("miss", 1.0)
    await a.tier.flush()
    b.clock.now = a.clock.now = 1004.0
    assert await b.serve(key) == ("l2", 1.0)  # written by a, read by b
    a.clock.now = 1006.0
    assert (await a.serve(key))[0] == "stale"
    await a.cache.flush()
    assert await a.serve(key) == ("l1", 1.0) and a.model.runs == 1
    # Once L2's copy is stale too, the refresh runs the model.
    a.clock.now = 1080.0  # (20 s past its TTL: within the grace window)
    assert (await a.serve(key))[0] == "stale"
    await a.cache.flush()
    assert a.model.runs == 2


async def test_invalidation_drops_the_results_under_a_prefix_from_l2_and_is_published(
    pair: tuple[Worker, Worker], prefix: str, store: Store
) -> None:
    a, b = pair
    for version in (1, 2):
        await a.cache.serve(a.view, f"{prefix}v{version}:k", "use", a.model)
    await a.tier.flush()
    report = await a.cache.invalidate(prefix + "v1:")
    # In L2: the result and the lease a computed it under.
    assert report == {"l1": 1, "l2": 2, "published": True}
    assert await store.exists(prefix + "v1:k") == 0 and await store.exists(prefix + "v2:k") == 1
    assert (await b.serve(prefix + "v1:k"))[0] == "miss"
    assert (await b.serve(prefix + "v2:k"))[0] == "l2"


@pytest.mark.parametrize("kind", ["memory", "redis-py"])
async def test_with_the_store_down_every_request_is_served_and_the_breaker_opens(
    kind: str, request: pytest.FixtureRequest
) -> None:
    own: Store
    if kind == "memory":
        own = MemoryStore()
    else:
        server = request.getfixturevalue("own_redis")
        own = RedisStore(kind, server.url, server)
    breaker = Breaker(clock=Clock(), threshold=3, open_s=60.0)
    # (Writes wait past the test: their failures would count against the breaker too.)
    tier = own.tier(budget_s=1.0, breaker=breaker, write_window_s=60.0)
    worker = Worker("a", tier, "m", CachePolicy())
    try:
        assert await worker.tier.connect()
        own.kill()
        answers = [await worker.serve(f"ts:{{m}}:v1:{i}") for i in range(6)]
        assert answers == [("miss", float(i + 1)) for i in range(6)]
        assert breaker.state is BreakerState.OPEN
        assert worker.tier.skips[("lookup", "error")] == 3
        assert worker.tier.skips[("lookup", "breaker")] == 3
        assert await worker.serve("ts:{m}:v1:0") == ("l1", 1.0)  # L1 serves as ever
    finally:
        await worker.cache.close()
        await own.close()
