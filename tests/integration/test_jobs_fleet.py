"""Jobs across processes: a worker killed (SIGKILL) while it holds jobs leaves them to another
(Redis), and `tailserve up` routes in-process jobs back to the worker that holds them."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.models import doubler_config, write_model
from support.servers import RedisServer, WorkerProcess, wait_for, worker_process
from support.up import tailserve_up


def x_request(value: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


@pytest.fixture
def slow_repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    # Each batch takes 0.3 s: a job seen running on a worker is still there when the test, a
    # few milliseconds later, kills it.
    write_model(repo, "crawl", doubler_config(parameters={"delay": 0.3}, warmup={"repeat": 0}))
    return repo


@contextlib.contextmanager
def two_workers(repository: Path, logs: Path, redis: RedisServer) -> Iterator[list[WorkerProcess]]:
    shared = ["--redis-url", redis.url, "--jobs-visibility-timeout", "1", "--jobs-concurrency", "2"]
    with (
        worker_process(repository, logs, "--worker-id", "a", *shared) as a,
        worker_process(repository, logs, "--worker-id", "b", *shared) as b,
    ):
        yield [a, b]


def test_jobs_a_killed_worker_held_finish_on_another_each_with_one_result(
    slow_repository: Path, tmp_path: Path, redis: RedisServer
) -> None:
    # One client for the polls: each would otherwise set up a client of its own, tens of
    # milliseconds on a slow machine, and twelve of them outlast a job's 0.3 s.
    with two_workers(slow_repository, tmp_path, redis) as (a, b), httpx.Client() as client:
        locations = []
        for i in range(12):
            reply = client.post(f"{a.url}/v2/models/crawl/jobs", json=x_request(float(i)))
            assert reply.status_code == 202, reply.text
            locations.append(reply.headers["location"])

        running_on_a: list[str] = []

        def held_by_a() -> bool:
            for location in locations:
                document = client.get(b.url + location).json()
                if document["status"] == "running" and document["worker"] == "a":
                    running_on_a.append(location)
                    return True
            return False

        wait_for(held_by_a, what="worker a to hold a job")
        os.kill(a.process.pid, signal.SIGKILL)
        a.process.wait(timeout=10)

        def all_finished() -> bool:
            statuses = [client.get(b.url + location).json()["status"] for location in locations]
            return all(status in ("succeeded", "failed") for status in statuses)

        wait_for(all_finished, timeout=60, what="every job to finish on worker b")
        documents = [client.get(b.url + location).json() for location in locations]
        for i, document in enumerate(documents):
            assert document["status"] == "succeeded", document
            assert document["result"]["outputs"][0]["data"] == [2.0 * i + 1.0]
        retried = [d for d in documents if d["attempts"] > 1]
        assert retried, "no job was taken again after the kill"
        assert running_on_a  # (the kill came while jobs were running)
        # Listed once each: one job, one result.
        listing = client.get(f"{b.url}/v2/jobs", params={"model": "crawl", "limit": "1000"})
        ids = [job["id"] for job in listing.json()["jobs"]]
        assert sorted(set(ids) & {d["id"] for d in documents}) == sorted(d["id"] for d in documents)
        assert len(ids) == len(set(ids))


def test_up_routes_in_process_jobs_to_the_worker_that_holds_them(
    slow_repository: Path, tmp_path: Path
) -> None:
    repo = slow_repository
    write_model(repo, "quick", doubler_config())
    with tailserve_up(repo, tmp_path, "--workers", "2") as up:
        ids: list[str] = []
        workers = set(up.worker_pids())

        def both_hold_some() -> bool:  # (which worker takes a job is the balancer's call)
            reply = httpx.post(f"{up.url}/v2/models/quick/jobs", json=x_request(float(len(ids))))
            assert reply.status_code == 202, reply.text
            ids.append(reply.json()["id"])
            return {job_id.split(".")[0] for job_id in ids} == workers

        # Each id names the worker that holds it.
        wait_for(both_hold_some, what="a job on each worker")
        for i, job_id in enumerate(ids):
            location = f"/v2/jobs/{job_id}"
            wait_for(
                lambda location=location: (
                    httpx.get(up.url + location).json()["status"] == "succeeded"
                ),
                what=f"job {job_id} through the front door",
            )
            document = httpx.get(up.url + location).json()
            assert document["result"]["outputs"][0]["data"] == [2.0 * i + 1.0]
        listing = httpx.get(f"{up.url}/v2/jobs", params={"model": "quick"}).json()
        assert sorted(job["id"] for job in listing["jobs"]) == sorted(ids)
        created = [job["created_at"] for job in listing["jobs"]]
        assert created == sorted(created, reverse=True)
        bad = httpx.get(f"{up.url}/v2/jobs", params={"status": "lost"})
        assert bad.status_code == 400
        gone = httpx.delete(f"{up.url}/v2/jobs/{ids[0]}")
        assert gone.status_code == 409  # found on its worker: already succeeded


def test_up_with_redis_runs_jobs_on_any_worker_through_the_front_door(
    slow_repository: Path, tmp_path: Path, redis: RedisServer
) -> None:
    repo = slow_repository
    write_model(repo, "brisk", doubler_config())
    with tailserve_up(repo, tmp_path, "--workers", "2", "--redis-url", redis.url) as up:
        ids = []
        for i in range(6):
            reply = httpx.post(f"{up.url}/v2/models/brisk/jobs", json=x_request(float(i)))
            assert reply.status_code == 202, reply.text
            ids.append(reply.json()["id"])
        assert all("." not in job_id for job_id in ids)  # shared: no worker's name in them
        for i, job_id in enumerate(ids):
            location = f"/v2/jobs/{job_id}"
            wait_for(
                lambda location=location: (
                    httpx.get(up.url + location).json()["status"] == "succeeded"
                ),
                what=f"job {job_id} through the front door",
            )
            assert httpx.get(up.url + location).json()["result"]["outputs"][0]["data"] == [
                2.0 * i + 1.0
            ]
        listing = httpx.get(f"{up.url}/v2/jobs", params={"model": "brisk"}).json()
        assert sorted(job["id"] for job in listing["jobs"]) == sorted(ids)
