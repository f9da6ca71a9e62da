"""Autoscaling `tailserve up` against real workers and a real HAProxy: a warm standby is promoted
through the runtime API in milliseconds and the pool refills; a worker leaving the rotation
finishes what it carries before it stops (no request fails); load scales the fleet up within
seconds and, once gone, down again."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from support.fleet import started
from support.models import doubler_config, write_model
from support.servers import async_wait_for
from tailserve.assembly.scaling import ScalingPlan
from tailserve.assembly.stack import FleetConfig, Supervisor
from tailserve.fleet.autoscaler import ScalingConfig
from tailserve.fleet.load import parse_stat
from tailserve.fleet.processes import Role

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}
INFER = "/v2/models/doubler/infer"
# The loop never decides on its own in the tests that drive the scaler's hands directly.
NEVER_S = 3600.0


def repository(root: Path, delay_s: float = 0.0) -> str:
    parameters = {"delay": delay_s} if delay_s else {}
    config = doubler_config(
        max_batch_size=1,
        parameters=parameters,
        slo={"p99_ms": 2000},
        warmup={"batch_sizes": [1]},
    )
    write_model(root / "repo", "doubler", config)
    return str(root / "repo")


def states(supervisor: Supervisor) -> dict[str, str]:
    return {w.name: w.state for w in supervisor.workers}


async def served_by(supervisor: Supervisor) -> dict[str, int]:
    """Requests each worker has had from the model's backend, by HAProxy's count."""
    stat = parse_stat(await supervisor.front_door_process.command("@1 show stat"))
    return {
        w.name: int(stat.get(("m.doubler", w.name), {}).get("stot") or 0)
        for w in supervisor.workers
    }


class Load:
    """``senders`` clients sending one request after another through the front door; every
    status is kept."""

    def __init__(self, url: str, senders: int) -> None:
        self.url = url
        self.senders = senders
        self.statuses: list[int] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._send()) for _ in range(self.senders)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _send(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                reply = await client.post(INFER, json=X)
                self.statuses.append(reply.status_code)


async def test_a_standby_is_promoted_in_milliseconds_and_the_pool_refills(tmp_path: Path) -> None:
    scaling = ScalingConfig(min_workers=1, max_workers=2, slo_s=2.0)
    config = FleetConfig(
        repository=repository(tmp_path),
        port=0,
        hedge_lane_ms=0,
        workers=1,
        drain_timeout_s=5,
        scaling=ScalingPlan(scaling=scaling, warm_pool=1, interval_s=NEVER_S, refill_after_s=1.0),
    )
    async with started(config) as supervisor, httpx.AsyncClient(base_url=supervisor.url) as c:
        await async_wait_for(
            lambda: asyncio.sleep(0, states(supervisor)["worker-1"] == "standby"),
            timeout_s=60,
            what="the warm pool's worker to be ready",
        )
        assert states(supervisor) == {
            "worker-0": "serving",
            "worker-1": "standby",
            "worker-2": "off",
        }
        fleet = (await c.get("/v2/fleet")).json()
        assert [w["state"] for w in fleet["workers"]] == ["serving", "standby", "off"]
        assert fleet["autoscaler"]["warm_pool"] == 1
        assert fleet["workers"][1]["cold_start_s"] > 0
        for _ in range(20):
            assert (await c.post(INFER, json=X)).status_code == 200
        assert (await served_by(supervisor))["worker-1"] == 0  # out of the rotation

        assert supervisor.scaler is not None
        await supervisor.scaler.apply(2)

        assert supervisor.workers[1].role is Role.SERVING
        assert supervisor.scaler.promotions_s[-1] < 0.25
        before = await served_by(supervisor)
        for _ in range(40):
            assert (await c.post(INFER, json=X)).status_code == 200
        after = await served_by(supervisor)
        assert after["worker-1"] > before["worker-1"]  # in the rotation at once
        assert states(supervisor)["worker-2"] == "off"  # not while the fleet grows
        await async_wait_for(
            lambda: asyncio.sleep(0, states(supervisor)["worker-2"] == "standby"),
            timeout_s=60,
            what="the pool to refill",
        )
        fleet = (await c.get("/v2/fleet")).json()
        assert fleet["autoscaler"]["promotion_s"] is not None


async def test_a_worker_leaving_the_rotation_finishes_its_requests_first(tmp_path: Path) -> None:
    scaling = ScalingConfig(min_workers=1, max_workers=2, slo_s=2.0)
    config = FleetConfig(
        repository=repository(tmp_path, delay_s=0.03),
        port=0,
        hedge_lane_ms=0,
        workers=2,
        drain_timeout_s=10,
        scaling=ScalingPlan(scaling=scaling, interval_s=NEVER_S),
    )
    async with started(config) as supervisor:
        assert supervisor.scaler is not None
        async with Load(supervisor.url, senders=8) as load:
            await async_wait_for(
                lambda: asyncio.sleep(0, len(load.statuses) >= 40), what="load to flow"
            )
            before = await served_by(supervisor)
            await supervisor.scaler.apply(1)
            leaving = next(w for w in supervisor.workers if w.role is Role.OFF)
            assert leaving.state == "draining"
            await async_wait_for(
                lambda: asyncio.sleep(0, leaving.state == "off"),
                timeout_s=20,
                what="the worker leaving to stop",
            )
            served = len(load.statuses)
            await async_wait_for(
                lambda: asyncio.sleep(0, len(load.statuses) >= served + 40),
                what="load on the worker that stays",
            )
        assert before[leaving.name] > 0  # it was taking its share when it left
        assert set(load.statuses) == {200}, sorted(set(load.statuses))


async def test_load_scales_the_fleet_up_within_seconds_and_down_when_it_ends(
    tmp_path: Path,
) -> None:
    scaling = ScalingConfig(
        min_workers=1,
        max_workers=2,
        slo_s=2.0,
        target_in_flight=2,
        upscale_delay_s=0.5,
        panic_delay_s=0.2,
        downscale_delay_s=2.0,
    )
    config = FleetConfig(
        repository=repository(tmp_path, delay_s=0.05),
        port=0,
        hedge_lane_ms=0,
        workers=1,
        drain_timeout_s=10,
        scaling=ScalingPlan(scaling=scaling, warm_pool=1, interval_s=0.2),
    )
    async with started(config) as supervisor:

        def serving() -> int:
            return sum(w.state == "serving" for w in supervisor.workers)

        await async_wait_for(
            lambda: asyncio.sleep(0, states(supervisor)["worker-1"] == "standby"),
            timeout_s=60,
            what="the warm pool's worker to be ready",
        )
        async with Load(supervisor.url, senders=8) as load:
            await async_wait_for(
                lambda: asyncio.sleep(0, serving() == 2), timeout_s=10, what="a scale-up"
            )
            assert supervisor.scaler is not None
            document = supervisor.scaler.document()
            assert document["wanted"] == 2 and "in flight" in document["reason"]
        await async_wait_for(
            lambda: asyncio.sleep(0, serving() == 1), timeout_s=30, what="a scale-down"
        )
        assert set(load.statuses) == {200}, sorted(set(load.statuses))


async def test_a_worker_exports_its_requests_in_flight(tmp_path: Path) -> None:
    # What a cluster's autoscaler divides by the requests a worker should carry.
    config = FleetConfig(
        repository=repository(tmp_path, delay_s=0.5),
        port=0,
        hedge_lane_ms=0,
        workers=1,
        drain_timeout_s=5,
    )

    async def in_flight(client: httpx.AsyncClient) -> float:
        page = (await client.get("/metrics")).text
        (line,) = [x for x in page.splitlines() if x.startswith("tailserve_requests_in_flight ")]
        return float(line.split()[1])

    async with started(config) as supervisor:
        url = supervisor.workers[0].url
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert await in_flight(client) == 1  # the scrape itself
            slow = [asyncio.create_task(client.post(INFER, json=X)) for _ in range(3)]
            await async_wait_for(
                lambda: _equals(in_flight(client), 4), what="three requests in flight"
            )
            assert all(r.status_code == 200 for r in await asyncio.gather(*slow))
            assert await in_flight(client) == 1


async def _equals(value: Any, expected: float) -> bool:
    return bool(await value == expected)
