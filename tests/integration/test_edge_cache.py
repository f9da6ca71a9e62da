"""The client's edge cache against a real worker on loopback and a real Redis: hot keys
answered in the caller's process, expiry, the workers' invalidations heard on pub/sub, a lost
subscription, and identical requests in flight sent once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from support.models import doubler_config, write_model
from support.servers import RedisServer, RunningWorker, async_wait_for, flush_redis, run_worker
from tailserve.client import Client, EdgeCache, InferenceError
from tailserve.settings import Settings

# A batch holding x = 4 waits for a gate file (warm-up's random inputs never do).
_HELD = """
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.gate = Path(config.parameters["gate"])

    def predict(self, inputs):
        x = inputs["x"]
        if np.isin(x, [4.0]).any():
            deadline = time.monotonic() + 20
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.002)
        return {"y": (x * 2).astype(np.float32)}
"""


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def x(value: float) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.array([[value]], dtype=np.float32)}


@pytest.fixture
def redis(redis: RedisServer) -> RedisServer:
    """The session's Redis, emptied: the worker's L2 must not answer from another test."""
    flush_redis(redis.url)
    return redis


@pytest.fixture
def worker(tmp_path: Path, redis: RedisServer) -> Iterator[RunningWorker]:
    cache = {"enabled": True, "ttl_s": 60}
    write_model(tmp_path, "m", doubler_config(cache=cache))
    write_model(tmp_path, "n", doubler_config(cache=cache))
    write_model(tmp_path, "plain", doubler_config())
    gated = doubler_config(cache=cache, parameters={"gate": str(tmp_path / "gate")})
    write_model(tmp_path, "held", gated, code=_HELD)
    settings = Settings(
        repository=str(tmp_path), redis_url=redis.url, worker_id="a", cache_l2_budget_ms=1000
    )
    with run_worker(settings) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def requests(http: httpx.AsyncClient, url: str, model: str) -> int:
    """Inference requests the worker answered for ``model``."""
    text = (await http.get(f"{url}/metrics")).text
    total = 0
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name == "tailserve_requests_total" and f'model="{model}"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


async def settled(http: httpx.AsyncClient, url: str, model: str, count: int) -> None:
    async def reached() -> bool:
        return await requests(http, url, model) >= count

    await async_wait_for(reached, what=f"{count} requests of {model} counted by the worker")


async def test_a_hot_key_is_answered_at_the_edge_until_its_ttl(
    worker: RunningWorker, http: httpx.AsyncClient
) -> None:
    clock = Clock()
    async with Client([worker.url], edge_cache=EdgeCache(ttl_s=5.0, clock=clock)) as client:
        first = await client.infer("m", x(1.5))
        assert first.edge == "miss" and first.parameters["cache"] == "miss"
        await settled(http, worker.url, "m", 1)
        for _ in range(50):
            hit = await client.infer("m", x(1.5))
            assert hit.edge == "hit" and hit.parameters["cache"] == "edge"
            assert hit.headers["x-cache"] == "edge" and hit.replica == worker.url
            assert hit.outputs["y"].tolist() == [[4.0]]
        assert await requests(http, worker.url, "m") == 1
        assert client.edge is not None and client.edge.hits == 50
        clock.now += 4.9
        assert (await client.infer("m", x(1.5))).edge == "hit"
        clock.now += 0.1
        expired = await client.infer("m", x(1.5))
        # Past the edge's TTL the worker answers again, from its own L1 (TTL 60 s).
        assert expired.edge == "miss" and expired.parameters["cache"] == "l1"
        await settled(http, worker.url, "m", 2)
        assert (await client.infer("m", x(1.5))).edge == "hit"
        assert await requests(http, worker.url, "m") == 2


async def test_only_cacheable_models_are_kept_and_the_cache_parameter_is_obeyed(
    worker: RunningWorker, http: httpx.AsyncClient
) -> None:
    async with Client([worker.url], edge_cache=EdgeCache(ttl_s=60)) as client:
        # A model its workers do not cache is not cached here either ...
        for _ in range(3):
            assert (await client.infer("plain", x(2.0))).edge is None
        await settled(http, worker.url, "plain", 3)
        # ... bypass goes to the worker and keeps nothing; refresh goes and keeps.
        await client.infer("m", x(2.0))
        bypass = await client.infer("m", x(2.0), parameters={"cache": "bypass"})
        assert bypass.edge is None and bypass.parameters["cache"] == "bypass"
        refresh = await client.infer("m", x(2.0), parameters={"cache": "refresh"})
        assert refresh.edge == "refresh" and refresh.parameters["cache"] == "refresh"
        await settled(http, worker.url, "m", 3)
        hit = await client.infer("m", x(2.0), parameters={"timeout": 5000})
        assert hit.edge == "hit"
        # Outputs asked for are part of the key; a hit's arrays are shared, so read-only.
        assert (await client.infer("m", x(2.0), outputs=["y"])).edge == "miss"
        with pytest.raises(ValueError, match="read-only"):
            hit.outputs["y"][0, 0] = 0.0
        await settled(http, worker.url, "m", 4)
        assert await requests(http, worker.url, "m") == 4
    # A model the caller names is cached whatever its workers do.
    async with Client([worker.url], edge_cache=EdgeCache(models={"plain"})) as client:
        assert (await client.infer("plain", x(2.0))).edge == "miss"
        assert (await client.infer("plain", x(2.0))).edge == "hit"


async def test_an_invalidation_through_a_worker_reaches_the_edge_by_pub_sub(
    worker: RunningWorker, redis: RedisServer, http: httpx.AsyncClient
) -> None:
    edge = EdgeCache(ttl_s=300, redis_url=redis.url)
    async with Client([worker.url], edge_cache=edge) as client:
        await async_wait_for(_holds(lambda: client.edge_subscribed), what="the edge subscribed")
        for model in ("m", "n"):
            await client.infer(model, x(3.0))
            assert (await client.infer(model, x(3.0))).edge == "hit"
        # Straight to the worker, not through the client: only Redis can tell the edge.
        report = await http.post(
            f"{worker.url}/v2/cache/invalidate", json={"model": "m", "version": 1}
        )
        assert report.status_code == 200 and report.json()["published"] is True
        assert client.edge is not None
        await async_wait_for(
            _holds(lambda: client.edge is not None and client.edge.invalidations >= 1),
            what="the invalidation to reach the edge",
        )
        assert client.edge.dropped == 1
        again = await client.infer("m", x(3.0))
        assert again.edge == "miss" and again.parameters["cache"] == "miss"
        assert (await client.infer("n", x(3.0))).edge == "hit"  # another model's: kept
        # An invalidation sent through the client drops the edge's entries at once.
        sent = await client.request("POST", "/v2/cache/invalidate", b'{"model": "n"}', model="n")
        assert sent.status == 200
        assert (await client.infer("n", x(3.0))).edge == "miss"
        # And the caller may drop the edge's own entries alone.
        assert client.invalidate_edge("m") == 1
        assert (await client.infer("m", x(3.0))).edge == "miss"


async def test_a_lost_subscription_drops_the_edge_when_it_comes_back(
    worker: RunningWorker, redis: RedisServer, admin: Any
) -> None:
    edge = EdgeCache(ttl_s=300, redis_url=redis.url)
    async with Client([worker.url], edge_cache=edge) as client:
        await async_wait_for(_holds(lambda: client.edge_subscribed), what="the edge subscribed")
        await client.infer("m", x(5.0))
        assert client.edge is not None and len(client.edge) == 1
        resets = client.edge.resets
        await admin.client_kill_filter(_type="pubsub")  # every subscriber: events may be lost
        await async_wait_for(
            _holds(lambda: client.edge is not None and client.edge.resets > resets),
            what="the edge to subscribe again",
        )
        assert len(client.edge) == 0
        assert (await client.infer("m", x(5.0))).edge == "miss"


async def test_identical_requests_in_flight_go_to_the_worker_once(
    worker: RunningWorker, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    async with Client([worker.url], edge_cache=EdgeCache(models={"held"})) as client:
        calls = [asyncio.create_task(client.infer("held", x(4.0))) for _ in range(20)]

        async def computing() -> bool:
            stats = (await http.get(f"{worker.url}/v2/models/held/stats")).json()
            batching = stats["model_stats"][0]["batching"]
            return bool(batching["queued"] + batching["busy_instances"])

        await async_wait_for(computing, what="the first request to reach the model")
        # One that cannot wait as long as the first takes gives up on its own deadline.
        with pytest.raises(InferenceError) as late:
            await client.infer("held", x(4.0), deadline_ms=50)
        assert late.value.status == 504
        (tmp_path / "gate").touch()
        results = await asyncio.gather(*calls)
        assert sorted(str(r.edge) for r in results) == ["coalesced"] * 19 + ["miss"]
        assert all(r.outputs["y"].tolist() == [[8.0]] for r in results)
        assert client.edge is not None and client.edge.coalesced == 19
        await settled(http, worker.url, "held", 1)
        assert await requests(http, worker.url, "held") == 1


async def test_waiting_requests_get_the_error_of_the_one_they_waited_for(
    worker: RunningWorker,
) -> None:
    async with Client([worker.url], edge_cache=EdgeCache(models={"nope"})) as client:
        calls = [client.infer("nope", x(1.0)) for _ in range(5)]
        errors = await asyncio.gather(*calls, return_exceptions=True)
        assert [getattr(e, "status", e) for e in errors] == [404] * 5
        assert client.edge is not None and len(client.edge) == 0


def _holds(predicate: Any) -> Any:
    async def check() -> bool:
        return bool(predicate())

    return check
