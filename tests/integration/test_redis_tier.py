"""The L2 tier: writes with their TTL, the time budget, the breaker, a crash and restart,
leases, invalidation by prefix, each against a real redis-server (over redis-py and over the
lean connection) and against the in-process twin (cache/inprocess.py); and what only Redis
has: one MGET per loop turn, the lean connection itself."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from support.l2 import KINDS, MemoryStore, RedisStore, Store
from support.servers import RedisServer, async_wait_for, command_calls
from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.keys import version_prefix
from tailserve.cache.redis import RedisTier
from tailserve.cache.resp import LeanRedis, RespError
from tailserve.cache.tier import CacheTier


def fresh_prefix() -> str:
    """A model of the test's own on the shared server."""
    return version_prefix(f"m-{uuid.uuid4().hex[:12]}", 1)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Redis with the hot path on redis-py, on the lean connection, and the twin."""
    kind: str = request.param
    return kind


@pytest.fixture
async def store(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """The session's Redis, or a twin of the test's own."""
    if kind == "memory":
        found: Store = MemoryStore()
    else:
        found = RedisStore(kind, request.getfixturevalue("redis").url)
    yield found
    await found.close()


@pytest.fixture
async def own_store(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """A store the test may pause, kill and restart without disturbing the others."""
    if kind == "memory":
        found: Store = MemoryStore()
    else:
        own = request.getfixturevalue("own_redis")
        found = RedisStore(kind, own.url, own)
    yield found
    await found.close()


@pytest.fixture
async def tier(store: Store) -> AsyncIterator[CacheTier]:
    # A budget no loaded test machine blows: these tests are about behaviour, not speed.
    tier = store.tier(budget_s=1.0)
    assert await tier.connect()
    yield tier
    await tier.close()


@pytest.fixture(params=["redis-py", "lean"])
async def redis_tier(redis: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The tier on the session's Redis (for what only Redis does)."""
    tier = RedisStore(request.param, redis.url).tier(budget_s=1.0)
    assert await tier.connect()
    yield tier
    await tier.close()


async def connected_clients(admin: Redis) -> int:
    return int((await admin.info("clients"))["connected_clients"])


async def test_connect_opens_the_lookup_connection_so_the_first_lookup_does_not(
    redis_tier: RedisTier, admin: Redis
) -> None:
    # A connection set up inside the first lookup would cost it most of its 5 ms budget.
    opened = await connected_clients(admin)
    assert await redis_tier.get(fresh_prefix() + "absent") is None
    assert await connected_clients(admin) == opened


async def test_lookups_made_in_one_loop_turn_go_to_redis_as_one_mget(
    redis_tier: RedisTier, admin: Redis
) -> None:
    tier = redis_tier
    prefix = fresh_prefix()
    keys = [f"{prefix}{i}" for i in range(20)]
    async with admin.pipeline(transaction=False) as pipe:
        for i, key in enumerate(keys):
            pipe.set(key, f"value-{i}", px=60_000)
        await pipe.execute()
    before = await command_calls(admin, "mget")

    values = await tier.get_many([*keys, prefix + "absent"])

    assert values == [f"value-{i}".encode() for i in range(20)] + [None]
    assert await command_calls(admin, "mget") == before + 1
    # Lookups awaited one after the other are one round trip each.
    assert await tier.get(keys[0]) == b"value-0"
    assert await tier.get(keys[1]) == b"value-1"
    assert await command_calls(admin, "mget") == before + 3


async def test_writes_are_stored_in_the_background_with_their_ttl(
    tier: CacheTier, store: Store
) -> None:
    prefix = fresh_prefix()
    items = {f"{prefix}{i}": bytes([i]) * 64 for i in range(10)}
    admin = store.admin if isinstance(store, RedisStore) else None
    before = 0 if admin is None else await command_calls(admin, "set")

    for key, value in items.items():
        tier.put(key, value, ttl_s=30)
    tier.put(prefix + "short", b"s", ttl_s=1.5)  # milliseconds, not rounded to seconds
    assert await store.exists(*items) == 0  # not yet: gathered for one pipeline
    await tier.put_now([(prefix + "now", b"n", 20)])

    await tier.flush()
    assert [await store.get(key) for key in items] == list(items.values())
    for key in items:
        assert 0 < (await store.pttl(key) or 0) <= 30_000
    assert 0 < (await store.pttl(prefix + "short") or 0) <= 1_500
    assert await store.get(prefix + "now") == b"n"
    assert 0 < (await store.pttl(prefix + "now") or 0) <= 20_000
    if admin is not None:  # one SET each, none repeated
        assert await command_calls(admin, "set") == before + len(items) + 2


async def test_writes_not_yet_sent_under_an_invalidated_prefix_never_reach_redis(
    tier: CacheTier, store: Store
) -> None:
    dropped, kept = fresh_prefix(), fresh_prefix()
    tier.put(dropped + "a", b"old", ttl_s=30)
    tier.put(kept + "b", b"v", ttl_s=30)
    assert tier.forget_writes(dropped) == 1
    await tier.flush()
    assert await store.exists(kept + "b") == 1
    assert await store.exists(dropped + "a") == 0  # it would have gone in the same pipeline


async def test_a_paused_redis_costs_a_lookup_its_budget_and_counts_as_a_failure(
    own_store: Store,
) -> None:
    # The socket timeout (what the client would wait) is well past the budget.
    tier = own_store.tier(socket_timeout_s=2.0, budget_s=0.1)
    try:
        assert await tier.connect()
        await tier.put_now([("k", b"v", 60)])
        assert await tier.get("k") == b"v"
        own_store.pause()
        try:
            started = time.perf_counter()
            assert await tier.get("k") is None
            # It waited its budget, and its budget (not the socket's 2 s timeout, an "error")
            # ended it. A busy machine can only make the wait longer.
            assert time.perf_counter() - started >= 0.09
            assert tier.skipped == 1 and tier.skips == {("lookup", "budget"): 1}

            async def failed() -> bool:
                return tier.breaker.failures == 1

            await async_wait_for(failed, what="the timed-out MGET to count as a failure")
            assert tier.breaker.state is BreakerState.CLOSED  # one failure is not enough
        finally:
            own_store.resume()

        async def hit() -> bool:
            return await tier.get("k") == b"v"

        await async_wait_for(hit, what="a hit once Redis answers again")
        assert tier.breaker.failures == 0
    finally:
        await tier.close()


async def test_lookups_that_run_out_of_budget_open_the_breaker_before_any_socket_timeout(
    own_store: Store,
) -> None:
    # A paused Redis answers nothing, and the socket would wait 30 s: each lookup that runs
    # out of its budget counts as a failure then, so three of them open the breaker.
    breaker = Breaker(clock=time.monotonic, threshold=3, open_s=60.0)
    tier = own_store.tier(socket_timeout_s=30.0, budget_s=0.05, breaker=breaker)
    try:
        assert await tier.connect()
        own_store.pause()
        try:
            assert [await tier.get(f"k{i}") for i in range(3)] == [None] * 3
            assert breaker.state is BreakerState.OPEN and tier.skipped == 3
            assert await tier.get("k") is None  # skipped at once: the breaker is open
            assert tier.skipped == 4 and breaker.failures == 3
            assert tier.skips == {("lookup", "budget"): 3, ("lookup", "breaker"): 1}
            tier.put("k", b"v", 60)  # not even queued: the breaker is open
            assert tier.skips[("write", "breaker")] == 1
        finally:
            own_store.resume()
    finally:
        await tier.close()


async def test_the_breaker_opens_after_repeated_failures_and_closes_when_redis_is_back(
    own_store: Store,
) -> None:
    # The breaker's clock is the test's: the cool-down ends when the test says, not when a
    # loaded machine happens to get round to the next line.
    now = [0.0]
    changes: list[BreakerState] = []
    breaker = Breaker(clock=lambda: now[0], threshold=3, open_s=0.5, on_change=changes.append)
    tier = own_store.tier(socket_timeout_s=0.2, budget_s=0.1, breaker=breaker)
    try:
        assert await tier.connect()
        await tier.put_now([("k", b"v", 60)])
        own_store.pause()
        try:

            async def opened() -> bool:
                assert await tier.get("k") is None
                return breaker.state is BreakerState.OPEN

            await async_wait_for(opened, what="the breaker to open")
            assert changes == [BreakerState.OPEN]
            assert breaker.failures >= 3

            # Open: lookups are skipped at once; none waits on the paused Redis (one that
            # did would be skipped for its budget, not for the breaker).
            skipped, skips = tier.skipped, tier.skips.copy()
            assert [await tier.get("k") for _ in range(20)] == [None] * 20
            assert tier.skipped == skipped + 20
            assert tier.skips - skips == {("lookup", "breaker"): 20}
            assert changes == [BreakerState.OPEN]
        finally:
            own_store.resume()

        async def closed() -> bool:
            now[0] += 10.0  # past any cool-down: the next lookup is a probe
            value = await tier.get("k")
            return breaker.state is BreakerState.CLOSED and value == b"v"

        await async_wait_for(closed, what="the breaker to close")
        # A probe closes it, or a lookup sent before it opened that Redis answered in time.
        assert changes[-1] is BreakerState.CLOSED
    finally:
        await tier.close()


async def test_lookups_miss_while_redis_is_down_and_hit_after_it_restarts_on_its_port(
    own_store: Store,
) -> None:
    breaker = Breaker(clock=time.monotonic, threshold=3, open_s=0.05, max_open_s=0.2)
    tier = own_store.tier(budget_s=0.5, breaker=breaker)
    try:
        assert await tier.connect()
        await tier.put_now([("k", b"before", 60)])
        assert await tier.get("k") == b"before"

        own_store.kill()
        for _ in range(10):
            assert await tier.get("k") is None  # refused: a miss, not an exception
        assert breaker.state is BreakerState.OPEN
        # Refused until the breaker opened (three failures), then not asked.
        assert tier.skips[("lookup", "error")] >= 3
        assert tier.skips[("lookup", "error")] + tier.skips[("lookup", "breaker")] == 10

        own_store.restart()  # empty: nothing was kept on disk
        await tier.put_now([("k", b"after", 60)])

        async def hit() -> bool:
            return await tier.get("k") == b"after"

        await async_wait_for(hit, what="a hit after the restart")
        assert tier.breaker.state is BreakerState.CLOSED
    finally:
        await tier.close()


async def test_a_lease_goes_to_the_first_caller_until_it_expires(
    tier: CacheTier, store: Store
) -> None:
    key = fresh_prefix() + "k"
    assert await tier.lease(key, "worker-a", ttl_s=0.5) is True
    assert await tier.lease(key, "worker-b", ttl_s=0.5) is False
    assert await store.get(key + ":lease") == b"worker-a"
    assert 0 < (await store.pttl(key + ":lease") or 0) <= 500

    async def taken() -> bool:
        return await tier.lease(key, "worker-c", ttl_s=0.5) is True

    await async_wait_for(taken, what="the lease to expire and be taken again")
    assert await store.get(key + ":lease") == b"worker-c"


async def test_a_lease_is_released_only_by_its_holder(tier: CacheTier, store: Store) -> None:
    key = fresh_prefix() + "k"
    assert await tier.lease(key, "worker-a", ttl_s=30.0) is True
    tier.release_lease(key, "worker-b")  # not b's to give back
    await tier.flush()
    assert await store.get(key + ":lease") == b"worker-a"
    tier.release_lease(key, "worker-a")
    await tier.flush()
    assert await store.get(key + ":lease") is None
    assert await tier.lease(key, "worker-b", ttl_s=30.0) is True  # at once, not in 30 s


async def test_drop_prefix_removes_exactly_the_keys_under_a_prefix_with_glob_characters(
    tier: CacheTier, store: Store
) -> None:
    tag = uuid.uuid4().hex[:12]
    prefix = f"ts:{{m*[x]?{tag}}}:v1:"
    doomed = [f"{prefix}{i}" for i in range(1200)]  # more than one UNLINK batch
    kept = [
        f"ts:{{mZx!{tag}}}:v1:0",  # matched by the prefix if * [x] ? were left unescaped
        f"ts:{{m*[x]?{tag}}}:v2:0",  # the same model, another version
        f"ts:{{m*[x]?{tag}}}:v1",  # not under the prefix: its last colon is missing
    ]
    await store.seed(dict.fromkeys([*doomed, *kept], b"x"))

    assert await tier.drop_prefix(prefix) == len(doomed)

    assert await store.exists(*doomed) == 0
    assert await store.exists(*kept) == len(kept)
    assert await tier.drop_prefix(prefix) == 0
    for key in kept:  # (the session's Redis is shared)
        await tier.drop_prefix(key)


async def test_the_lean_connection_pipelines_selects_its_database_and_reports_errors(
    redis: RedisServer,
) -> None:
    from redis.asyncio import Redis as Admin

    url = redis.url.rsplit("/", 1)[0] + "/3"
    lean = LeanRedis(url)
    other = Admin.from_url(url)
    try:
        prefix = fresh_prefix()
        await lean.set_many([(f"{prefix}{i}", b"v%d" % i, 60_000) for i in range(50)])
        assert await other.get(f"{prefix}7") == b"v7"  # in database 3, as the URL says
        assert 0 < await other.pttl(f"{prefix}7") <= 60_000
        values = await asyncio.gather(*(lean.mget([f"{prefix}{i}", "absent"]) for i in range(50)))
        assert values == [[b"v%d" % i, None] for i in range(50)]
        with pytest.raises(RespError, match="expire"):
            await lean.set_many([(prefix + "bad", b"x", -5)])
        assert await lean.mget([f"{prefix}1"]) == [b"v1"]  # the connection goes on
    finally:
        await lean.close()
        await other.aclose()
