"""Many models across a stack (`tailserve up`'s supervisor, the real HAProxy): workers under a
memory budget that holds one model each; a model loaded nowhere still reaches a worker (the cold
backend), which loads it, and then the front door sends each model's requests only to the
worker where it is loaded."""

from __future__ import annotations

from pathlib import Path

import httpx

from support.ballast import X, ballasted_repository, infer
from support.fleet import started
from support.servers import async_wait_for
from tailserve.assembly.stack import FleetConfig, Supervisor
from tailserve.fleet.load import parse_stat

WORKERS = ("worker-0", "worker-1")


async def up_in(stack: Supervisor, backend: str) -> set[str]:
    """The workers the front door sends ``backend``'s requests to now ("UP 1/2": one check
    has failed, it still does)."""
    try:
        stat = parse_stat(await stack.front_door_process.command("@1 show stat"))
    except OSError:  # (its master socket, while a reload re-creates it)
        return set()
    return {w for w in WORKERS if stat.get((backend, w), {}).get("status", "").startswith("UP")}


async def test_each_models_requests_go_to_the_worker_where_it_is_loaded(tmp_path: Path) -> None:
    # Two models of 16 MiB; each worker's budget (24 MiB) holds one: both load `a` at start.
    repository = ballasted_repository(tmp_path / "repo", ["a", "b"])
    config = FleetConfig(
        repository=str(repository),
        port=0,
        workers=2,
        drain_timeout_s=5,
        hedge_lane_ms=0,
        worker_args=("--model-memory-mb", "24"),
    )
    async with started(config) as stack, httpx.AsyncClient(base_url=stack.url, timeout=20) as c:

        async def settled(model: str, workers: set[str]) -> bool:
            return await up_in(stack, f"m.{model}") == workers

        await async_wait_for(lambda: settled("a", set(WORKERS)), what="a up on both workers")
        assert await up_in(stack, "m.b") == set()
        # b is loaded nowhere: the cold backend sends it to one worker, which loads it (the
        # request waits for the load), unloading a there.
        reply = await c.post(infer("b"), json=X, headers={"X-Deadline-Ms": "10000"})
        assert reply.status_code == 200, reply.text
        holder = reply.headers["x-tailserve-replica"]
        other = next(w for w in WORKERS if w != holder)
        await async_wait_for(lambda: settled("b", {holder}), what=f"b up on {holder} alone")
        await async_wait_for(lambda: settled("a", {other}), what=f"a up on {other} alone")

        for model, worker in (("b", holder), ("a", other)) * 10:
            reply = await c.post(infer(model), json=X)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-tailserve-replica"] == worker, model
        # KServe v1 records are routed the same way.
        v1 = await c.post("/v1/models/b:predict", json={"instances": [{"x": 1.0}]})
        assert v1.status_code == 200 and v1.headers["x-tailserve-replica"] == holder
        # No worker took the other's model back: each loaded once at start, b once more.
        metrics = (await c.get("/metrics")).text
    loads = [
        line
        for line in metrics.splitlines()
        if line.startswith("tailserve_model_load_seconds_count")
    ]
    assert sorted(line.rsplit(" ", 1)[1] for line in loads) == ["1.0", "1.0", "1.0"], loads
