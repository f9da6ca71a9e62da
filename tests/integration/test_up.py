"""`tailserve up`: the front door answers for its workers, a killed worker comes back on its
port, and SIGTERM (to the process or its group) drains the whole stack and exits 0."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.grpc as triton_grpc

from support.churn import grpc_inputs
from support.servers import async_wait_for, free_port, wait_for
from support.up import alive, tailserve_up
from tailserve.assembly.stack import FleetConfig, Supervisor
from tailserve.examples.churn import FIELDS, sample_rows
from tailserve.fleet.processes import ManagedWorker
from tailserve.fleet.restarts import Backoff
from tailserve.frontdoor.render import FrontDoorPolicy


def churn_request(rows: int = 2, seed: int = 5) -> dict[str, Any]:
    sample = sample_rows(rows, seed)
    inputs = [
        {"name": f.name, "datatype": f.datatype, "shape": [rows, 1], "data": sample[f.name]}
        for f in FIELDS
    ]
    return {"inputs": inputs}


def assert_scored(reply: httpx.Response, rows: int = 2) -> None:
    assert reply.status_code == 200, reply.text
    (output,) = reply.json()["outputs"]
    assert output["name"] == "churn_probability"
    assert len(output["data"]) == rows
    assert all(0.0 <= p <= 1.0 for p in output["data"])


def grpc_calls(worker_url: str) -> float:
    """The churn gRPC calls a worker has answered (its own /metrics)."""
    text = httpx.get(f"{worker_url}/metrics").text
    prefix = 'tailserve_requests_total{model="churn",protocol="grpc",status="200"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_up_serves_inference_through_the_front_door_from_every_worker(
    example_repository: Path, tmp_path: Path
) -> None:
    grpc_port = free_port()
    options = (
        "--workers",
        "2",
        "--balance",
        "round-robin",
        # churn by its affinity key: over gRPC, the key as metadata (below)
        "--model-balance",
        "churn=affinity",
        "--drain-timeout",
        "5",
        "--grpc-port",
        str(grpc_port),
    )
    with tailserve_up(example_repository, tmp_path, *options) as up:
        ready = f"tailserve up: front door on {up.url} (gRPC on port {grpc_port}), 2 workers ready"
        assert ready in up.log()
        assert httpx.get(f"{up.url}/v2/health/ready").status_code == 200
        replicas: set[str] = set()
        with httpx.Client(base_url=up.url) as client:
            keys = itertools.count()

            def both_have_answered() -> bool:
                key = {"X-Affinity-Key": f"probe-{next(keys)}"}
                reply = client.post("/v2/models/churn/infer", json=churn_request(), headers=key)
                assert_scored(reply)
                replicas.add(reply.headers["x-tailserve-replica"])
                return len(replicas) == 2

            # The front door may not have seen the second worker ready yet: it checks each second.
            wait_for(both_have_answered, timeout=10, what="both workers to answer")
        assert replicas == set(up.worker_pids())
        # gRPC clients reach the same workers through the front door's gRPC port.
        inputs = grpc_inputs(2, seed=5)
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            assert client.is_server_ready() and client.is_model_ready("churn")
            scores = client.infer("churn", inputs).as_numpy("churn_probability")
            # Calls with the same affinity key (as metadata) all go to one worker.
            workers = [w["url"] for w in httpx.get(f"{up.url}/v2/fleet").json()["workers"]]
            before = [grpc_calls(url) for url in workers]
            for _ in range(8):
                client.infer("churn", inputs, headers={"x-affinity-key": "customer-17"})
            grew = [grpc_calls(url) - was for url, was in zip(workers, before, strict=True)]
            assert sorted(grew) == [0, 8]
        http_scores = httpx.post(f"{up.url}/v2/models/churn/infer", json=churn_request()).json()
        assert scores.ravel().tolist() == pytest.approx(http_scores["outputs"][0]["data"])
        # Each worker serves gRPC itself, on loopback, behind the front door.
        assert up.log().count("gRPC (OIP v2) on 127.0.0.1:") == 2
        # A default start (the examples, the ranker among them, without Redis) says nothing
        # at ERROR: the ranker not served without a feature store is a note.
        assert " ERROR " not in up.log() and "Traceback" not in up.log()


@pytest.mark.parametrize("to_group", [False, True], ids=["to-the-process", "to-its-group"])
def test_sigterm_drains_the_stack_and_exits_0(
    churn_repository: Path, tmp_path: Path, to_group: bool
) -> None:
    with tailserve_up(churn_repository, tmp_path, "--workers", "2", session=to_group) as up:
        pids = up.worker_pids()
        (door,) = up.front_door_pids()
        assert len(pids) == 2
        assert all(alive(pid) for pid in [*pids.values(), door])
        # The fleet's /metrics reads HAProxy's exporter: that connection must not hold the
        # drain open until its timeout (30 s).
        assert httpx.get(f"{up.url}/metrics").status_code == 200
        begun = time.monotonic()
        if to_group:  # as a supervisor or `make` passes it on: every process of the group
            os.killpg(up.process.pid, signal.SIGTERM)
        else:
            up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(timeout=60) == 0, up.log()
        assert time.monotonic() - begun < 15, "the drain waited for an idle connection"
        assert not [pid for pid in [*pids.values(), door] if alive(pid)]
        log = up.log()
        assert all(f"{name} (pid {pid}) exited with 0" in log for name, pid in pids.items())
        assert "killed" not in log


def test_up_without_a_repository_folder_says_so(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tailserve.cli", "up", "--repository", str(tmp_path / "no")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "no model repository" in done.stderr


def test_up_on_a_taken_port_says_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "up",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--repository",
            str(tmp_path),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert f"the front door cannot start on 127.0.0.1:{port}" in done.stderr
    assert "cannot bind socket" in done.stderr
    assert "started (pid" not in done.stderr


async def test_a_killed_worker_comes_back_on_its_port(churn_repository: Path) -> None:
    config = FleetConfig(
        repository=str(churn_repository),
        host="127.0.0.1",
        port=0,
        workers=2,
        drain_timeout_s=5.0,
        backoff=Backoff(first_s=0.1),
        # Round-robin, so that the last check sees the front door send to it again whatever
        # its latency.
        policy=FrontDoorPolicy(balance="round-robin"),
    )
    supervisor = Supervisor(config)
    await supervisor.start()
    try:
        await asyncio.wait_for(supervisor.ready.wait(), timeout=90)
        victim = supervisor.workers[0]
        pid, port = victim.pid, victim.port
        assert pid is not None
        async with httpx.AsyncClient(base_url=supervisor.url) as client:

            async def infer() -> httpx.Response:
                return await client.post("/v2/models/churn/infer", json=churn_request())

            # The front door must have found both workers ready (it checks each second) for one
            # to take over from the other.
            replicas: set[str] = set()

            async def both_answer() -> bool:
                reply = await infer()
                assert_scored(reply)
                replicas.add(reply.headers["x-tailserve-replica"])
                return len(replicas) == 2

            await async_wait_for(both_answer, what="both workers to answer through the front door")
            for _ in range(100):
                assert_scored(await infer())
            os.kill(pid, signal.SIGKILL)
            await async_wait_for(_gone(victim), what="the supervisor to see the worker die")
            replies: list[httpx.Response] = []

            async def restarted() -> bool:
                replies.append(await infer())
                return victim.ready

            await async_wait_for(restarted, timeout_s=60, what="the worker's restart")
            assert victim.pid != pid
            assert victim.port == port
            assert victim.restarts == 1
            for reply in replies:
                assert_scored(reply)

            async def routed_to_it_again() -> bool:
                reply = await infer()
                assert_scored(reply)
                return reply.headers["x-tailserve-replica"] == victim.name

            # The front door's checks marked it down when it died, and up again after.
            try:
                await async_wait_for(routed_to_it_again, timeout_s=30, what="traffic to it again")
            except AssertionError as timed_out:
                state = (await client.get("/v2/fleet")).text
                raise AssertionError(f"{timed_out}; the fleet: {state}") from None
    finally:
        await supervisor.stop()
    assert not any(worker.running for worker in supervisor.workers)


def _gone(worker: ManagedWorker) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not worker.ready

    return check
