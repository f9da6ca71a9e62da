"""The stack's front door (HAProxy) and admin lane, against real workers: admission by a
bounded queue, reloads without a dropped request, and the fleet's own routes (invalidation on
every worker, one /metrics, the admin token beyond loopback)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from support.fleet import held, started
from support.models import doubler_config, write_model
from support.servers import async_wait_for
from support.stub import StubApp, run_stub
from tailserve.assembly.stack import FleetConfig, Supervisor
from tailserve.fleet.load import parse_stat
from tailserve.fleet.processes import free_ports
from tailserve.frontdoor.haproxy import HAProxy
from tailserve.frontdoor.render import FrontDoorPolicy, Listen, Member, render

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}


def infer(model: str) -> str:
    return f"/v2/models/{model}/infer"


@pytest.fixture
async def two_workers(tmp_path: Path) -> AsyncIterator[Supervisor]:
    write_model(tmp_path / "repo", "doubler", doubler_config(cache={"enabled": True}))
    config = FleetConfig(repository=str(tmp_path / "repo"), port=0, workers=2, drain_timeout_s=5)
    async with started(config) as supervisor:
        yield supervisor


async def test_an_overflowing_queue_answers_503_at_once(tmp_path: Path) -> None:
    # One worker, one request in flight and one queued: the rest are refused at the door.
    # The SLO sets the queue's timeout (half of it, 5 s): a refusal that had waited in the
    # queue would come after that, one at the door within a small part of it.
    # Each takes 1 s: the first is still running when the last four come.
    slow = doubler_config(
        parameters={"delay": 1.0}, slo={"p99_ms": 10_000}, warmup={"batch_sizes": [1]}
    )
    write_model(tmp_path / "repo", "slow", slow)
    policy = FrontDoorPolicy(max_conn=1, max_queue=1)
    # No hedging lane: a model this slow would take it, and the lane has no such bound.
    config = FleetConfig(
        repository=str(tmp_path / "repo"),
        port=0,
        policy=policy,
        drain_timeout_s=5,
        hedge_lane_ms=0,
    )
    async with (
        started(config) as stack,
        httpx.AsyncClient(base_url=stack.url, timeout=10) as client,
    ):

        async def one() -> tuple[int, float, httpx.Response]:
            begun = time.perf_counter()
            reply = await client.post(infer("slow"), json=X)
            return reply.status_code, time.perf_counter() - begun, reply

        # Two first; the next four once the door holds one in flight and one queued (sent
        # together, all six could pass the door's check before any of them was queued).
        first = [asyncio.create_task(one()) for _ in range(2)]

        async def in_door() -> bool:
            return await held(stack.front_door_process, "m.slow", "worker-0") >= 2

        await async_wait_for(in_door, what="one request in flight and one queued")
        rest = await asyncio.gather(*(one() for _ in range(4)))
        results = [*await asyncio.gather(*first), *rest]
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(served) == 2 and len(refused) == 4, [r[0] for r in results]
    for _, took, reply in refused:
        assert took < 2.5, f"a refusal took {took:.3f} s: it waited in the queue"
        assert reply.headers["retry-after"] == "1"
        assert "busy" in reply.json()["error"]


async def test_a_model_loaded_later_gets_a_backend_without_a_dropped_request(
    two_workers: Supervisor,
) -> None:
    stack = two_workers
    repository = Path(stack.config.repository)
    failures: list[str] = []
    sent = 0
    stop = asyncio.Event()

    async def keep_sending(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while not stop.is_set():
            reply = await client.post(infer("doubler"), json=X)
            sent += 1
            if reply.status_code != 200:
                failures.append(f"{reply.status_code} {reply.text}")

    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        senders = [asyncio.create_task(keep_sending(client)) for _ in range(4)]
        for round_ in range(3):
            name = f"tripler{round_}"
            shutil.copytree(repository / "doubler", repository / name)
            loaded = await client.post(f"/v2/repository/models/{name}/load")
            assert loaded.status_code == 200, loaded.text
            assert set(loaded.json()["workers"]) == {"worker-0", "worker-1"}

            async def answers(model: str = name) -> bool:
                return (await client.post(infer(model), json=X)).status_code == 200

            await async_wait_for(answers, what=f"{name} to be served through the front door")
        stop.set()
        await asyncio.gather(*senders)
        fleet = (await client.get("/v2/fleet")).json()
    assert fleet["front_door"]["reloads"] == 3
    assert {"doubler", "tripler0", "tripler1", "tripler2"} <= set(fleet["front_door"]["models"])
    assert sent > 50
    assert failures == []


async def test_invalidation_reaches_every_worker_without_redis(two_workers: Supervisor) -> None:
    async with httpx.AsyncClient(base_url=two_workers.url, timeout=10) as client:
        cached: set[str] = set()

        async def both_cached() -> bool:
            # The same input on both workers (p2c spreads them), until each holds it in L1.
            reply = await client.post(infer("doubler"), json=X)
            if reply.headers.get("x-cache") == "l1":
                cached.add(reply.headers["x-tailserve-replica"])
            return cached == {"worker-0", "worker-1"}

        await async_wait_for(both_cached, what="both workers to hold the entry")
        done = await client.post("/v2/cache/invalidate", json={"model": "doubler"})
        assert done.status_code == 200, done.text
        report = done.json()["workers"]
        assert {name: r["reply"]["l1"] for name, r in report.items()} == {
            "worker-0": 1,
            "worker-1": 1,
        }
        for _ in range(10):
            reply = await client.post(infer("doubler"), json=X)
            assert reply.headers["x-cache"] in ("miss", "l1")
        assert cached


async def test_one_metrics_page_holds_every_worker_and_the_front_door(
    two_workers: Supervisor,
) -> None:
    async with httpx.AsyncClient(base_url=two_workers.url, timeout=10) as client:
        for _ in range(10):
            assert (await client.post(infer("doubler"), json=X)).status_code == 200
        page = (await client.get("/metrics")).text
    for source in ("worker-0", "worker-1", "frontdoor"):
        assert f'worker="{source}"' in page
    assert "tailserve_request_duration_seconds_bucket{" in page
    assert "haproxy_backend_http_responses_total{" in page
    # One HELP a family, however many workers report it.
    assert page.count("# HELP tailserve_request_duration_seconds ") == 1


async def test_beyond_loopback_the_fleets_admin_routes_need_a_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_model(tmp_path / "repo", "doubler", doubler_config())
    config = FleetConfig(
        repository=str(tmp_path / "repo"), host="0.0.0.0", port=0, drain_timeout_s=5
    )
    async with (
        started(config) as stack,
        httpx.AsyncClient(base_url=stack.url, timeout=10) as client,
    ):
        refused = await client.post("/v2/cache/invalidate", json={"model": "doubler"})
        assert refused.status_code == 403
        assert "--admin-token" in refused.json()["error"]
        assert (await client.post(infer("doubler"), json=X)).status_code == 200
        assert (await client.get("/v2/fleet")).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("admin routes closed" in message for message in warnings)


async def test_a_front_door_that_dies_is_started_again(two_workers: Supervisor) -> None:
    door = two_workers.front_door_process
    first = door.pid
    assert first is not None
    os.killpg(first, signal.SIGKILL)

    async def serving_again() -> bool:
        if door.pid == first or not door.running:
            return False
        async with httpx.AsyncClient(base_url=two_workers.url, timeout=5) as client:
            return (await client.post(infer("doubler"), json=X)).status_code == 200

    await async_wait_for(serving_again, timeout_s=30, what="the front door to serve again")


async def test_a_slow_model_takes_the_hedging_lane_and_a_fast_one_goes_direct(
    tmp_path: Path,
) -> None:
    repository = tmp_path / "repo"
    write_model(repository, "fast", doubler_config())
    write_model(
        repository, "slow", doubler_config(parameters={"delay": 0.25}, slo={"p99_ms": 2000})
    )
    config = FleetConfig(
        repository=str(repository), port=0, workers=2, drain_timeout_s=5, classify_interval_s=0.2
    )
    async with (
        started(config) as stack,
        httpx.AsyncClient(base_url=stack.url, timeout=10) as client,
    ):

        async def laned() -> bool:
            fleet = (await client.get("/v2/fleet")).json()
            return fleet["front_door"]["lane"]["models"] == ["slow"]

        await async_wait_for(laned, what="the slow model to take the lane")

        async def through_the_lane() -> bool:
            # The lane (the Python router) names the worker by its URL.
            reply = await client.post(infer("slow"), json=X)
            assert reply.status_code == 200, reply.text
            return reply.headers["x-tailserve-replica"].startswith("http://127.0.0.1:")

        await async_wait_for(through_the_lane, what="the slow model's replies from the lane")
        fast = await client.post(infer("fast"), json=X)
        assert fast.status_code == 200
        assert fast.headers["x-tailserve-replica"] in {"worker-0", "worker-1"}


async def test_affinity_sends_one_key_to_one_worker_and_spreads_the_keys(tmp_path: Path) -> None:
    write_model(tmp_path / "repo", "doubler", doubler_config())
    config = FleetConfig(
        repository=str(tmp_path / "repo"),
        port=0,
        workers=2,
        drain_timeout_s=5,
        policy=FrontDoorPolicy(balance="affinity"),
    )
    async with started(config) as stack, httpx.AsyncClient(base_url=stack.url, timeout=10) as c:

        async def both_up() -> bool:  # (a key sent while one is still down goes to the other)
            try:
                stat = parse_stat(await stack.front_door_process.command("@1 show stat"))
            except OSError:
                return False
            rows = [stat.get(("m.doubler", w), {}) for w in ("worker-0", "worker-1")]
            return [row.get("status") for row in rows] == ["UP", "UP"]

        await async_wait_for(both_up, what="both workers up in the model's backend")
        by_key: dict[str, set[str]] = {}
        for key in (f"user-{n}" for n in range(40)):
            for _ in range(3):
                reply = await c.post(infer("doubler"), json=X, headers={"X-Affinity-Key": key})
                assert reply.status_code == 200
                by_key.setdefault(key, set()).add(reply.headers["x-tailserve-replica"])
        # Without the header, the body is the key: the same body, the same worker.
        bodies = {
            (await c.post(infer("doubler"), json=X)).headers["x-tailserve-replica"]
            for _ in range(10)
        }
    assert all(len(workers) == 1 for workers in by_key.values()), by_key
    assert {next(iter(w)) for w in by_key.values()} == {"worker-0", "worker-1"}
    assert len(bodies) == 1


async def test_a_worker_that_keeps_failing_is_ejected(tmp_path: Path) -> None:
    # Both answer their readiness checks; one fails every request. HAProxy alone, in front of
    # two stubs, with the rendered config: `observe layer7` takes the failing one out after
    # `error_limit` errors in a row, well before its next check.
    with run_stub(StubApp()) as good, run_stub(StubApp(status=500)) as bad:
        members = [Member("good", "127.0.0.1", good.port), Member("bad", "127.0.0.1", bad.port)]
        port = free_ports(1)[0]
        # Its checks would pass: none comes while the test runs, so only its errors count.
        policy = FrontDoorPolicy(
            error_limit=3,
            check_interval_ms=60_000,
            down_check_interval_ms=60_000,
            max_connections=500,
        )
        door = HAProxy(tmp_path)
        await door.start(render(Listen(host="127.0.0.1", port=port), members, {}, policy))
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                statuses = [(await client.post(infer("m"), json=X)).status_code for _ in range(60)]
        finally:
            await door.drain(1.0)
    assert 3 <= statuses.count(500) <= 4, statuses
    assert statuses[-30:] == [200] * 30
