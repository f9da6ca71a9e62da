"""Traces through the routing lane (`tailserve route`) in front of a real worker on loopback:
the lane's server span under the incoming traceparent, its attempts as client spans, the
worker's spans under the attempt that reached it, the front door's span made once (by the
lane), and the lane's own refusals saying why."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from support.models import doubler_config, write_model
from support.servers import RunningWorker, async_wait_for, free_port, run_worker, wait_for
from tailserve.observability.tracing import start_tracing
from tailserve.router.config import RouterConfig
from tailserve.router.proxy import Router
from tailserve.settings import Settings

BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [2.0]}]}
PARENT_SPAN = 0xB7AD6B7169203331


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningWorker, Any]]:
    repository = tmp_path_factory.mktemp("traced-lane")
    write_model(repository, "m", doubler_config())
    write_model(repository, "slow", doubler_config(parameters={"delay": 0.3}, warmup={}))
    exporter = InMemorySpanExporter()
    tracing = start_tracing("tailserve-worker", exporter=exporter, sample=0.0)
    with run_worker(Settings(repository=str(Path(repository))), tracing=tracing) as running:
        yield running, exporter


async def traced_router(backends: list[str], exporter: Any, **changes: Any) -> Router:
    options: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "health_interval_s": 0.1}
    options.update(changes)
    router = Router(RouterConfig(backends=tuple(backends), **options))
    router.tracing = start_tracing("tailserve-router", exporter=exporter, sample=1.0)
    await router.start()
    return router


@pytest.fixture
async def lane(worker: tuple[RunningWorker, Any]) -> AsyncIterator[tuple[Router, Any]]:
    exporter = InMemorySpanExporter()
    router = await traced_router([worker[0].url], exporter)
    try:
        yield router, exporter
    finally:
        await router.drain(timeout_s=5)


def spans_of(exporter: Any, trace_id: str, name: str) -> dict[str, ReadableSpan]:
    def mine() -> list[ReadableSpan]:
        return [
            s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id
        ]

    wait_for(lambda: any(s.name == name for s in mine()), what=f"the {name} span")
    return {span.name: span for span in mine()}


async def test_the_lane_spans_a_request_and_its_attempts(
    worker: tuple[RunningWorker, Any], lane: tuple[Router, Any]
) -> None:
    _, worker_spans = worker
    router, lane_spans = lane
    trace = "9af7651916cd43dd8448eb211c80319c"
    stamp = int(time.time() * 1e6) - 2_000
    headers = {
        "traceparent": f"00-{trace}-b7ad6b7169203331-01",
        "x-frontdoor-received-us": str(stamp),
    }
    async with httpx.AsyncClient() as client:
        reply = await client.post(f"{router.url}/v2/models/m/infer", json=BODY, headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-trace-id"] == trace
    mine = spans_of(lane_spans, trace, "route")
    route, attempt, door = mine["route"], mine["attempt first"], mine["frontdoor"]
    assert route.kind.name == "SERVER" and route.parent.span_id == PARENT_SPAN
    assert route.attributes["tailserve.model"] == "m"
    assert route.attributes["http.response.status_code"] == 200
    assert route.attributes["tailserve.replica"] == reply.headers["x-tailserve-replica"]
    assert attempt.kind.name == "CLIENT" and attempt.parent.span_id == route.context.span_id
    assert attempt.attributes["tailserve.won"] is True
    assert door.start_time == stamp * 1000 and door.parent.span_id == PARENT_SPAN
    theirs = spans_of(worker_spans, trace, "request")
    assert theirs["request"].parent.span_id == attempt.context.span_id
    assert "frontdoor" not in theirs  # the lane made it: the stamp is not sent on


async def test_a_shed_says_why(worker: tuple[RunningWorker, Any]) -> None:
    running, _ = worker
    exporter = InMemorySpanExporter()
    # Nothing listens at the first backend: no replica of anything is in service there.
    nobody = await traced_router([f"http://127.0.0.1:{free_port()}"], exporter)
    try:
        async with httpx.AsyncClient() as client:
            reply = await client.post(f"{nobody.url}/v2/models/m/infer", json=BODY)
        assert reply.status_code == 503
        assert reply.headers["x-refusal-reason"] == "no_replica"
        assert reply.json()["reason"] == "no_replica"
        trace = reply.headers.get("x-trace-id")
        assert trace is None  # (no worker answered: the lane's own reply)
        (route,) = [s for s in exporter.get_finished_spans() if s.name == "route"]
        assert route.attributes["tailserve.refusal_reason"] == "no_replica"
    finally:
        await nobody.drain(timeout_s=5)
    full = await traced_router([running.url], exporter, max_in_flight=1, hedge=False)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            url = f"{full.url}/v2/models/slow/infer"
            first = asyncio.create_task(client.post(url, json=BODY))

            async def one_in_flight() -> bool:
                return full.dispatcher.backends[0].in_flight == 1

            await async_wait_for(one_in_flight, what="one request in flight")
            second = await client.post(url, json=BODY)
            assert (await first).status_code == 200
        assert second.status_code == 503
        assert second.headers["x-refusal-reason"] == "saturated"
    finally:
        await full.drain(timeout_s=5)
