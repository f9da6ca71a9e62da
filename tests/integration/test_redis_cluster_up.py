"""`tailserve up` on a Redis Cluster with replicas, named by a ``redis+cluster://`` URL: the
master holding a cached model's keys and an entity's features is killed under load. No request
fails that could be served: the cached model answers throughout (computing while L2 is out), an
entity on another master is read throughout, and the dead master's entity is refused (503) only
from the kill until the breaker's first probe after its replica took over. Then, with the same
workers, a result one worker writes is another's L2 hit, the entity is read again, and an
invalidation reaches the other worker (whose subscription was on the dead node)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from support.fleet import started
from support.models import doubler_config, write_model
from support.servers import RunningRedisCluster, async_wait_for
from tailserve.assembly.stack import FleetConfig, Supervisor
from tailserve.cache.feature_store import FeatureStore
from tailserve.cache.redis import connect

IDS = 200  # entities of each kind in the store; f0 of id i is i / 4
SENDERS = 6


def x_body(x: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}


def id_body(entity_id: int) -> dict[str, Any]:
    return {"inputs": [{"name": "id", "datatype": "INT64", "shape": [1], "data": [entity_id]}]}


def features_model(entity: str) -> dict[str, Any]:
    """The doubler, its x being feature f0 of the entity named by `id`; every read goes to
    the store (no in-process feature cache, no result cache)."""
    spec = {"input": "x", "key": "id", "entity": entity, "fields": ["f0"]}
    return doubler_config(features={"version": "1", "ttl_s": 0, "inputs": [spec]})


async def load_features(url: str, *entities: str) -> None:
    store = FeatureStore(connect(url, timeout_s=5.0), timeout_s=5.0)
    try:
        values = (np.arange(IDS, dtype=np.float32) / 4)[:, None]
        for entity in entities:
            await store.write_matrix(entity, "1", range(IDS), ["f0"], values)
    finally:
        await store.close()


@dataclass(frozen=True)
class Reply:
    kind: str  # hit, miss (the cached model), near (the victim's entity), far (another's)
    sent: float
    done: float
    status: int
    cache: str | None
    text: str


class Load:
    """Closed-loop senders through the front door, each cycling through the four kinds."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.replies: list[Reply] = []
        self._unique = itertools.count(10_000)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._send(i)) for i in range(SENDERS)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _send(self, index: int) -> None:
        rng = random.Random(index)
        kinds = itertools.cycle(["hit", "near", "miss", "far"])
        for _ in range(index):
            next(kinds)
        while not self._stop.is_set():
            kind = next(kinds)
            if kind == "hit":
                path, body = "/v2/models/doubler/infer", x_body(float(rng.randrange(8)))
            elif kind == "miss":
                path, body = "/v2/models/doubler/infer", x_body(float(next(self._unique)))
            else:
                path, body = f"/v2/models/{kind}/infer", id_body(rng.randrange(IDS))
            sent = time.monotonic()
            try:
                reply = await self.client.post(path, json=body)
                status, cache, text = reply.status_code, reply.headers.get("x-cache"), reply.text
            except httpx.HTTPError as exc:
                status, cache, text = 0, None, repr(exc)
            self.replies.append(Reply(kind, sent, time.monotonic(), status, cache, text))

    def count(self, kind: str, after: float = 0.0) -> int:
        return sum(r.kind == kind and r.sent >= after for r in self.replies)


async def test_a_master_killed_under_load_loses_no_request_that_could_be_served(
    tmp_path: Path, replicated_cluster: RunningRedisCluster
) -> None:
    cluster = replicated_cluster
    victim = cluster.owner("{doubler}")  # the cached model's keys (hash tag) live there
    # Entity types (their keys share a slot) on that master and on another.
    near, far = cluster.tag_on(victim), cluster.tag_on(victim, elsewhere=True)
    # The stack knows the cluster by the node about to die: nothing may depend on it.
    url = f"redis+cluster://127.0.0.1:{victim}"
    await load_features(url, near, far)
    repository = tmp_path / "repo"
    # No L1: every lookup of the cached model goes to Redis.
    write_model(
        repository, "doubler", doubler_config(cache={"enabled": True, "l1": {"enabled": False}})
    )
    write_model(repository, "kept", doubler_config(cache={"enabled": True}))  # with an L1
    write_model(repository, "near", features_model(near))
    write_model(repository, "far", features_model(far))
    config = FleetConfig(
        repository=str(repository),
        port=0,
        workers=2,
        drain_timeout_s=5,
        hedge_lane_ms=0,
        worker_args=("--redis-url", url),
    )
    async with (
        started(config) as stack,
        httpx.AsyncClient(base_url=stack.url, timeout=10) as client,
    ):
        pids = [w.pid for w in stack.workers]
        async with Load(client) as load:
            await async_wait_for(
                _every_kind_served(load), timeout_s=30, what="every kind of request served"
            )
            killed = time.monotonic()
            cluster.kill(victim)
            await asyncio.to_thread(cluster.wait_failed_over, victim)
            promoted = time.monotonic()

            async with httpx.AsyncClient(timeout=10) as direct:
                await async_wait_for(
                    _l2_shared(direct, stack), timeout_s=30, what="an L2 hit across workers"
                )
            recovered = time.monotonic()
            await async_wait_for(
                _served_since(load, "near", recovered), timeout_s=30, what="the store again"
            )
            async with httpx.AsyncClient(timeout=10) as direct:
                await _invalidation_reaches_the_other_worker(direct, stack)
        replies = load.replies
        # The same workers all along: nothing was restarted.
        assert [w.pid for w in stack.workers] == pids
        assert [w.restarts for w in stack.workers] == [0, 0]

    refused = [r for r in replies if r.status != 200]
    near_refused = [r for r in refused if r.kind == "near"]
    failover = promoted - killed
    summary = (
        f"failover {failover:.2f} s; L2 shared across workers again {recovered - promoted:.2f} s "
        f"after it; {len(replies)} requests, {sum(r.sent >= killed for r in replies)} from the "
        f"kill; the dead master's entity refused {len(near_refused)} times "
        f"({_reasons(near_refused)}), the last sent {_last(near_refused, promoted)} after the "
        "promotion"
    )
    print(summary)
    # The cached model and the other master's entity: every request answered, all along.
    assert [r for r in refused if r.kind != "near"] == [], summary
    assert any(r.kind == "hit" and r.cache == "l2" and r.sent >= recovered for r in replies)
    for kind in ("hit", "miss", "near", "far"):
        assert load.count(kind, after=killed) > 0, kind
    assert sum(killed <= r.sent <= promoted and r.kind != "near" for r in replies) > 0
    # The dead master's entity: refused only from the kill until its breaker's first probe
    # after the promotion. The cool-down starts at 0.5 s and doubles while probes fail, so
    # the last one begun before the promotion is at most the failover + 0.5 s; 1 s more for
    # this loaded machine and the front door's checks.
    for reply in near_refused:
        assert reply.done >= killed, reply
        assert reply.sent <= promoted + failover + 0.5 + 1.0, summary
        assert _reason(reply) != "other", reply


def _every_kind_served(load: Load) -> Any:
    async def check() -> bool:
        return all(
            any(r.kind == kind and r.status == 200 for r in load.replies)
            for kind in ("hit", "miss", "near", "far")
        )

    return check


def _served_since(load: Load, kind: str, since: float) -> Any:
    async def check() -> bool:
        return any(r.kind == kind and r.status == 200 and r.sent >= since for r in load.replies)

    return check


def _l2_shared(client: httpx.AsyncClient, stack: Supervisor) -> Any:
    """A result the first worker computed is the second's L2 hit, signed by the first: the
    first computes a fresh input, reads it back from L2 (it has no L1) once its write is
    there, then the second asks for it."""
    first, second = stack.workers[:2]
    signature = first.name  # (the supervisor's --worker-id)
    fresh = itertools.count(1_000_000)
    written: list[dict[str, Any]] = []

    async def ask(url: str, body: dict[str, Any]) -> httpx.Response:
        reply = await client.post(f"{url}/v2/models/doubler/infer", json=body)
        assert reply.status_code == 200, reply.text
        return reply

    async def check() -> bool:
        if not written:
            body = x_body(float(next(fresh)))
            if (await ask(first.url, body)).headers["x-cache"] == "miss":
                written.append(body)
            return False
        if (await ask(first.url, written[0])).headers["x-cache"] != "l2":
            return False  # not stored yet (or the first worker's breaker is still open)
        reply = await ask(second.url, written.pop())
        shared: dict[str, Any] = reply.json()["parameters"]
        # A miss (its own breaker still open) has no signature: not yet.
        return (shared.get("cache"), shared.get("cache_computed_by")) == ("l2", signature)

    return check


async def _invalidation_reaches_the_other_worker(
    client: httpx.AsyncClient, stack: Supervisor
) -> None:
    """An invalidation sent to the first worker alone drops the second's L1 entry: the second's
    subscription, on the node the URL named, came back on another."""
    first, second = stack.workers[:2]
    body = x_body(0.5)
    infer = f"{second.url}/v2/models/kept/infer"

    async def cached() -> bool:
        return (await client.post(infer, json=body)).headers["x-cache"] == "l1"

    await async_wait_for(cached, what="the second worker's L1 entry")
    done = await client.post(f"{first.url}/v2/cache/invalidate", json={"model": "kept"})
    assert done.status_code == 200, done.text

    async def dropped() -> bool:
        reply = await client.post(infer, json=body)
        assert reply.status_code == 200, reply.text
        return reply.headers["x-cache"] != "l1"

    await async_wait_for(dropped, timeout_s=15, what="the invalidation to reach the second")


def _reason(reply: Reply) -> str:
    """Why the front door's answer was not a 200, when the store's entity could not be read."""
    if reply.status == 503 and "feature store" in reply.text:
        return "store"  # the worker's 503: the store failed, or the breaker is open
    if reply.status == 503 and "no worker can take the request" in reply.text:
        # The front door's: every worker was marked down for this model after 10 errors in a
        # row (`observe layer7`), until its next readiness check.
        return "front door"
    if reply.status == 0 and "RemoteProtocolError" in reply.text:
        return "disconnected"  # the front door closed the connection while marking them down
    return "other"


def _reasons(refused: list[Reply]) -> str:
    counts: dict[str, int] = {}
    for reply in refused:
        counts[_reason(reply)] = counts.get(_reason(reply), 0) + 1
    return ", ".join(f"{reason} {count}" for reason, count in sorted(counts.items()))


def _last(refused: list[Reply], promoted: float) -> str:
    return f"{max(r.sent for r in refused) - promoted:+.2f} s" if refused else "(none)"
