"""The L2 tier against a real three-node Redis Cluster: a model's keys in one slot, models
spread over the nodes, writes with their TTL, invalidation by prefix across nodes, and pub/sub
from one node to a subscriber on another. Against one with replicas: after a master dies and its
replica takes over, the tier and the feature store read from the replica, with no new client."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis, RedisCluster

from support.servers import RunningRedisCluster, async_wait_for, command_calls
from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.feature_store import FeatureStore
from tailserve.cache.keys import model_prefix, version_prefix
from tailserve.cache.redis import INVALIDATION_CHANNEL, RedisTier, connect
from tailserve.errors import Unavailable


def fresh_model(name: str = "m") -> str:
    return f"{name}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def tier(redis_cluster: RunningRedisCluster) -> AsyncIterator[RedisTier]:
    tier = RedisTier(connect(redis_cluster.url, cluster=True), budget_s=1.0, cluster=True)
    assert await tier.connect()
    yield tier
    await tier.close()


@pytest.fixture
async def admin(redis_cluster: RunningRedisCluster) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.url)
    yield client
    await client.aclose()


@pytest.fixture
async def nodes(redis_cluster: RunningRedisCluster) -> AsyncIterator[list[Redis]]:
    """A plain client to each node (what a worker's invalidation subscriber uses)."""
    clients = [Redis.from_url(redis_cluster.node_url(i)) for i in range(len(redis_cluster.ports))]
    yield clients
    for client in clients:
        await client.aclose()


async def mget_calls(nodes: list[Redis]) -> int:
    total = 0
    for node in nodes:
        stats = await node.info("commandstats")
        total += int(stats.get("cmdstat_mget", {}).get("calls", 0))
    return total


async def keys_on(node: Redis, pattern: str) -> list[bytes]:
    return [key async for key in node.scan_iter(match=pattern, count=1000)]


async def test_one_models_keys_share_a_slot_and_a_batch_lookup_is_one_mget(
    tier: RedisTier, nodes: list[Redis]
) -> None:
    prefix = version_prefix(fresh_model(), 1)
    keys = [f"{prefix}{i:03d}" for i in range(50)]
    slots = {int(await nodes[0].execute_command("CLUSTER", "KEYSLOT", key)) for key in keys}
    assert len(slots) == 1
    await tier.put_now([(key, key.encode(), 60) for key in keys])
    before = await mget_calls(nodes)

    values = await tier.get_many([*keys, prefix + "absent"])

    assert values == [key.encode() for key in keys] + [None]
    assert await mget_calls(nodes) == before + 1


async def test_the_keys_of_many_models_spread_over_the_nodes(
    tier: RedisTier, nodes: list[Redis]
) -> None:
    family = fresh_model("spread")
    keys = [version_prefix(f"{family}-{i}", 1) + "k" for i in range(30)]
    await tier.put_now([(key, key.encode(), 60) for key in keys])

    held = [len(await keys_on(node, f"ts:{{{family}-*")) for node in nodes]

    assert sum(held) == len(keys)
    assert sum(1 for count in held if count > 0) >= 2, held
    # One lookup batch across slots and nodes: one MGET per slot, answers in order.
    assert await tier.get_many(keys) == [key.encode() for key in keys]


async def test_writes_reach_every_node_with_their_ttl(tier: RedisTier, admin: RedisCluster) -> None:
    family = fresh_model("ttl")
    keys = [version_prefix(f"{family}-{i}", 1) + "k" for i in range(12)]
    for key in keys:
        tier.put(key, b"v", ttl_s=30)
    short = version_prefix(f"{family}-short", 1) + "k"
    tier.put(short, b"s", ttl_s=1.5)

    async def stored() -> bool:
        return int(await admin.exists(*keys, short)) == len(keys) + 1

    await async_wait_for(stored, what="the background writes")
    # The short one first, soon after its write: it is gone 1.5 s after it.
    assert 0 < await admin.pttl(short) <= 1_500
    for key in keys:
        assert await admin.get(key) == b"v"
        assert 0 < await admin.pttl(key) <= 30_000


async def test_drop_prefix_removes_one_models_keys_from_the_cluster_and_no_others(
    tier: RedisTier, admin: RedisCluster, nodes: list[Redis]
) -> None:
    model = fresh_model()
    doomed = [version_prefix(model, v) + f"{i}" for v in (1, 2) for i in range(20)]
    kept = [
        version_prefix(f"{model}x", 1) + "0",  # a longer name: ts:{<model>x}: is not ts:{<model>}:
        *(version_prefix(fresh_model("other"), 1) + "0" for _ in range(10)),
    ]
    await tier.put_now([(key, b"x", 60) for key in [*doomed, *kept]])
    before = [await command_calls(node, "unlink") for node in nodes]

    assert await tier.drop_prefix(model_prefix(model)) == len(doomed)

    assert await admin.exists(*doomed) == 0
    assert await admin.exists(*kept) == len(kept)
    # The model's keys share a slot: one UNLINK for all 40, not one each.
    after = [await command_calls(node, "unlink") for node in nodes]
    assert sum(after) - sum(before) == 1


async def test_drop_prefix_above_the_model_spans_slots_and_nodes(
    tier: RedisTier, admin: RedisCluster, nodes: list[Redis]
) -> None:
    family = fresh_model("family")
    doomed = [version_prefix(f"{family}-{i}", 1) + "k" for i in range(30)]
    kept = version_prefix(fresh_model("other"), 1) + "k"
    await tier.put_now([(key, b"x", 60) for key in [*doomed, kept]])
    held = [len(await keys_on(node, f"ts:{{{family}-*")) for node in nodes]
    assert sum(1 for count in held if count > 0) >= 2, held

    assert await tier.drop_prefix(f"ts:{{{family}-") == len(doomed)

    assert await admin.exists(*doomed) == 0
    assert await admin.exists(kept) == 1


async def next_message(pubsub: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is not None and message["type"] == "message":
            return dict(message)
    raise AssertionError(f"no message within {timeout_s}s")


async def test_a_message_published_on_one_node_reaches_a_subscriber_on_another(
    tier: RedisTier, nodes: list[Redis]
) -> None:
    pubsub = nodes[2].pubsub()
    try:
        await pubsub.subscribe(INVALIDATION_CHANNEL)
        confirmation = await pubsub.get_message(timeout=5.0)
        assert confirmation is not None and confirmation["type"] == "subscribe"

        payload = f"drop {model_prefix(fresh_model())}".encode()
        # PUBLISH counts only the receivers on the node it was sent to: none on node 0.
        assert await nodes[0].publish(INVALIDATION_CHANNEL, payload) == 0
        message = await next_message(pubsub)
        assert (message["channel"], message["data"]) == (INVALIDATION_CHANNEL.encode(), payload)

        # Through the tier's cluster client, whichever node it sends to.
        await tier.publish(INVALIDATION_CHANNEL, b"second " + payload)
        assert (await next_message(pubsub))["data"] == b"second " + payload
    finally:
        await pubsub.unsubscribe()
        await pubsub.aclose()


# --- a master dies and its replica takes over -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_after_a_failover_the_tier_and_the_store_read_from_the_promoted_replica(
    replicated_cluster: RunningRedisCluster,
) -> None:
    # The breakers run on the test's clock: their probes go when it says, not after cool-downs.
    cluster = replicated_cluster
    victim = cluster.owner("{m}")
    near, far = cluster.tag_on(victim), cluster.tag_on(victim, elsewhere=True)
    key = version_prefix("m", 1) + "k"
    url = f"redis+cluster://127.0.0.1:{victim}"  # the node the clients start from dies
    clock = Clock()
    tier = RedisTier(connect(url), budget_s=1.0, cluster=True, breaker=Breaker(clock=clock))
    store = FeatureStore(connect(url, timeout_s=2.0), timeout_s=2.0, cluster=True, clock=clock)
    try:
        await tier.put_now([(key, b"v", 60)])
        for entity in (near, far):
            await store.write_matrix(entity, "1", range(3), ["f0"], np.ones((3, 1), np.float32))
        async with Redis(port=victim) as master:  # the replica holds all of it
            assert await master.execute_command("WAIT", 1, 5000) == 1

        cluster.kill(victim)
        # The dead master's failures leave the other reads alone: no slot map or command
        # table read first (redis-py's own path does, at the next command of any slot, one
        # read at a time). Three failures: its breaker (of five) stays closed.
        live = [Redis(port=port) for port in cluster.alive()]
        try:
            before = await _topology_reads(live)
            for _ in range(3):
                with pytest.raises(Unavailable):
                    await store.read(near, "1", [1], ["f0"])
                assert (await store.read(far, "1", [2], ["f0"])).tolist() == [[1.0]]
            assert await _topology_reads(live) == before
            assert store.breaker(near).state is BreakerState.CLOSED
        finally:
            for client in live:
                await client.aclose()
        for _ in range(5):
            assert await tier.get(key) is None
            with pytest.raises(Unavailable):
                await store.read(near, "1", [1], ["f0"])
            # Another master's entity is read all along (and the client has read the slot map
            # again since: it still names the dead master).
            assert (await store.read(far, "1", [1], ["f0"])).tolist() == [[1.0]]
        assert tier.breaker.state is BreakerState.OPEN
        assert store.breaker(near).state is BreakerState.OPEN
        assert store.breaker(far).state is BreakerState.CLOSED
        await asyncio.to_thread(cluster.wait_failed_over, victim)

        clock.now += 60  # the cool-downs are over: the next call of each is a probe
        assert (await store.read(near, "1", [1], ["f0"])).tolist() == [[1.0]]
        assert await tier.get(key) is None  # the probe's lookup: a miss, answered at once

        async def closed() -> bool:
            return tier.breaker.state is BreakerState.CLOSED

        await async_wait_for(closed, what="the tier's probe to close its breaker")
        assert await tier.get(key) == b"v"
        tier.put(key + "2", b"w", ttl_s=60)
        await tier.flush()
        assert await tier.get(key + "2") == b"w"
    finally:
        await tier.close()
        await store.close()


async def _topology_reads(nodes: list[Redis]) -> list[tuple[int, int]]:
    """How many times each node has answered CLUSTER SLOTS and COMMAND."""
    return [
        (await command_calls(n, "cluster|slots"), await command_calls(n, "command")) for n in nodes
    ]
