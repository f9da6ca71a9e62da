"""The jobs API of a real worker on loopback, with the in-process store and with Redis: submit,
poll, list, cancel, the bound, errors, the webhook's retries, and a job of more rows than a
batch holds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from support.models import doubler_config, write_model
from support.servers import RedisServer, RunningWorker, run_worker, wait_for
from tailserve.errors import QueueFull
from tailserve.jobs import desk as desk_module
from tailserve.jobs.desk import JobDesk
from tailserve.jobs.store import MemoryJobStore
from tailserve.settings import Settings

STORES = ["memory", "redis"]

# Fails on a negative x: a job's error comes from the model, when it runs.
PICKY = """
import numpy as np


class Model:
    def __init__(self, version_dir, config):
        pass

    def predict(self, inputs):
        if (inputs["x"] < 0).any():
            raise ValueError("x must not be negative")
        return {"y": inputs["x"].astype(np.float32)}
"""


def x_request(*values: float) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(values), 1], "data": values}]
    }


def settings_for(store: str, repository: Path, redis: RedisServer, **changes: Any) -> Settings:
    settings = Settings(repository=str(repository), **changes)
    if store == "redis":
        settings = settings.replace(redis_url=redis.url)
    return settings


@pytest.fixture(scope="module", params=STORES)
def worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, redis: RedisServer
) -> Iterator[RunningWorker]:
    """A worker that runs jobs: `doubler` (y = 2x + 1, 16 rows a batch), `slow` (each batch
    takes 3 s, its jobs more urgent: still running when a test at idle priority, its polls
    seconds apart, cancels it) and `picky` (fails on a negative x)."""
    repo = tmp_path_factory.mktemp("jobs-repo")
    write_model(repo, "doubler", doubler_config(jobs={"priority": 3}))
    write_model(
        repo,
        "slow",
        doubler_config(parameters={"delay": 3.0}, warmup={"repeat": 0}, jobs={"priority": 2}),
    )
    write_model(repo, "picky", doubler_config(warmup={"repeat": 0}), code=PICKY)
    with run_worker(settings_for(request.param, repo, redis)) as running:
        yield running


@pytest.fixture(scope="module", params=STORES)
def idle_worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, redis: RedisServer
) -> Iterator[RunningWorker]:
    """A worker that takes jobs but runs none (jobs_concurrency 0): they stay queued. Its model
    `held` takes at most 3 waiting."""
    repo = tmp_path_factory.mktemp("idle-repo")
    write_model(repo, "held", doubler_config(jobs={"max_queued": 3}))
    write_model(repo, "nojobs", doubler_config(jobs={"enabled": False}))
    settings = settings_for(request.param, repo, redis, jobs_concurrency=0)
    with run_worker(settings) as running:
        yield running


def finished(url: str, location: str, timeout: float = 30.0) -> dict[str, Any]:
    """The job's document once it has finished."""
    documents: list[dict[str, Any]] = []

    def done() -> bool:
        document = httpx.get(url + location).json()
        documents.append(document)
        return document["status"] in ("succeeded", "failed", "cancelled")

    wait_for(done, timeout=timeout, what=f"job {location} to finish")
    return documents[-1]


def test_a_job_is_accepted_at_once_and_its_result_is_what_infer_answers(
    worker: RunningWorker,
) -> None:
    body = x_request(1.0, 2.5, -3.0)
    reply = httpx.post(f"{worker.url}/v2/models/doubler/jobs", json=body)
    assert reply.status_code == 202
    document = reply.json()
    assert document["status"] == "queued"
    assert reply.headers["location"] == f"/v2/jobs/{document['id']}"
    done = finished(worker.url, reply.headers["location"])
    assert done["status"] == "succeeded", done
    online = httpx.post(f"{worker.url}/v2/models/doubler/infer", json=body).json()
    assert done["result"]["outputs"][0]["data"] == online["outputs"][0]["data"] == [3.0, 6.0, -5.0]
    assert done["attempts"] == 1
    timings = done["timings"]
    assert timings["total_ms"] >= timings["run_ms"] >= 0
    assert done["started_at"] >= done["created_at"]


def test_a_job_of_more_rows_than_a_batch_runs_in_pieces_and_keeps_its_order(
    worker: RunningWorker,
) -> None:
    values = [float(i) for i in range(1000)]  # a batch holds 16
    reply = httpx.post(f"{worker.url}/v2/models/doubler/jobs", json=x_request(*values))
    assert reply.status_code == 202, reply.text
    done = finished(worker.url, reply.headers["location"])
    assert done["status"] == "succeeded", done
    assert done["result"]["outputs"][0]["data"] == [2 * v + 1 for v in values]
    assert done["result"]["outputs"][0]["shape"] == [1000, 1]


def test_kserve_v1_records_submit_as_jobs_too(worker: RunningWorker) -> None:
    reply = httpx.post(
        f"{worker.url}/v1/models/doubler/jobs", json={"instances": [{"x": 1.0}, {"x": 4.0}]}
    )
    assert reply.status_code == 202, reply.text
    done = finished(worker.url, reply.headers["location"])
    assert done["result"] == {"predictions": [3.0, 9.0]}


def test_binary_outputs_asked_of_a_job_come_back_as_json(worker: RunningWorker) -> None:
    body = {**x_request(2.0), "parameters": {"binary_data_output": True}}
    reply = httpx.post(f"{worker.url}/v2/models/doubler/jobs", json=body)
    done = finished(worker.url, reply.headers["location"])
    assert done["result"]["outputs"][0]["data"] == [5.0]


def test_a_running_job_cancelled_keeps_no_result(worker: RunningWorker) -> None:
    with httpx.Client(base_url=worker.url) as client:  # (one client: polls milliseconds apart)
        location = client.post("/v2/models/slow/jobs", json=x_request(1.0)).headers["location"]
        wait_for(
            lambda: client.get(location).json()["status"] == "running",
            what="the slow job to start",
        )
        cancelled = client.delete(location)
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        runner = worker.worker.job_runner
        wait_for(lambda: runner.running == 0, what="the runner to let the job go")
        document = client.get(location).json()
    assert document["status"] == "cancelled"
    assert "result" not in document


def test_a_job_the_model_fails_on_keeps_the_error(worker: RunningWorker) -> None:
    reply = httpx.post(f"{worker.url}/v2/models/picky/jobs", json=x_request(-1.0))
    done = finished(worker.url, reply.headers["location"])
    assert done["status"] == "failed"
    assert "x must not be negative" in done["error"]
    assert "result" not in done
    assert done["attempts"] == 1  # not run again: it would fail again


def test_a_worker_takes_the_most_urgent_models_jobs_first(worker: RunningWorker) -> None:
    # (Each store's take honours this order: tests/integration/test_job_stores.py.)
    assert worker.worker.job_runner.models() == ["picky", "slow", "doubler"]


def test_errors_name_the_problem(worker: RunningWorker) -> None:
    url = worker.url
    bad = httpx.post(f"{url}/v2/models/doubler/jobs", json={"inputs": []})
    assert bad.status_code == 400
    assert "input 'x' is missing" in bad.json()["error"]
    unknown = httpx.post(f"{url}/v2/models/nosuch/jobs", json=x_request(1.0))
    assert unknown.status_code == 404
    hook = httpx.post(
        f"{url}/v2/models/doubler/jobs", json=x_request(1.0), headers={"x-webhook-url": "ftp://h"}
    )
    assert hook.status_code == 400
    assert "webhook" in hook.json()["error"]
    assert httpx.get(f"{url}/v2/jobs/{'0' * 32}").status_code == 404
    assert httpx.get(f"{url}/v2/jobs/a%20b").status_code == 400
    assert httpx.get(f"{url}/v2/jobs?status=lost").status_code == 400
    assert httpx.get(f"{url}/v2/jobs?status=").status_code == 400  # blank is no status
    assert httpx.get(f"{url}/v2/jobs?limit=0").status_code == 400
    assert httpx.get(f"{url}/v2/jobs?colour=red").status_code == 400
    assert httpx.get(f"{url}/v2/health/live").status_code == 200  # still serving


def test_a_finished_job_cannot_be_cancelled(worker: RunningWorker) -> None:
    reply = httpx.post(f"{worker.url}/v2/models/doubler/jobs", json=x_request(1.0))
    finished(worker.url, reply.headers["location"])
    refused = httpx.delete(worker.url + reply.headers["location"])
    assert refused.status_code == 409
    assert "already succeeded" in refused.json()["error"]


def test_the_bound_refuses_with_429_and_retry_after_and_cancel_makes_room(
    idle_worker: RunningWorker,
) -> None:
    url = idle_worker.url
    locations = []
    for _ in range(3):
        reply = httpx.post(f"{url}/v2/models/held/jobs", json=x_request(1.0))
        if reply.status_code == 429:  # left queued by an earlier test of this worker
            break
        locations.append(reply.headers["location"])
    full = httpx.post(f"{url}/v2/models/held/jobs", json=x_request(1.0))
    assert full.status_code == 429
    assert int(full.headers["retry-after"]) >= 1
    assert "held" in full.json()["error"]
    listing = httpx.get(f"{url}/v2/jobs", params={"model": "held", "status": "queued"}).json()
    queued = [job["id"] for job in listing["jobs"]]
    assert len(queued) == 3
    cancelled = httpx.delete(f"{url}/v2/jobs/{queued[0]}")
    assert cancelled.json()["status"] == "cancelled"
    again = httpx.delete(f"{url}/v2/jobs/{queued[0]}")
    assert again.status_code == 200  # cancelling twice is no error
    room = httpx.post(f"{url}/v2/models/held/jobs", json=x_request(1.0))
    assert room.status_code == 202
    for job_id in queued[1:]:
        httpx.delete(f"{url}/v2/jobs/{job_id}")
    httpx.delete(url + room.headers["location"])


def test_a_listing_filters_by_model_and_status_newest_first(idle_worker: RunningWorker) -> None:
    url = idle_worker.url
    ids = [
        httpx.post(f"{url}/v2/models/held/jobs", json=x_request(float(i))).json()["id"]
        for i in range(2)
    ]
    httpx.delete(f"{url}/v2/jobs/{ids[0]}")
    cancelled = httpx.get(f"{url}/v2/jobs", params={"model": "held", "status": "cancelled"})
    assert ids[0] in [job["id"] for job in cancelled.json()["jobs"]]
    queued = httpx.get(f"{url}/v2/jobs", params={"model": "held", "status": "queued"}).json()
    assert [job["id"] for job in queued["jobs"]] == [ids[1]]
    assert "result" not in queued["jobs"][0]
    one = httpx.get(f"{url}/v2/jobs", params={"model": "held", "limit": "1"}).json()
    assert [job["id"] for job in one["jobs"]] == [ids[1]]  # the newest
    assert one["truncated"] is True
    httpx.delete(f"{url}/v2/jobs/{ids[1]}")


def test_a_model_may_take_no_jobs(idle_worker: RunningWorker) -> None:
    refused = httpx.post(f"{idle_worker.url}/v2/models/nojobs/jobs", json=x_request(1.0))
    assert refused.status_code == 400
    assert "takes no jobs" in refused.json()["error"]


class Receiver:
    """A webhook receiver on loopback that answers 503 to its first ``failures`` deliveries."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with receiver.lock:
                    receiver.bodies.append(orjson.loads(body))
                    status = 503 if len(receiver.bodies) <= receiver.failures else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None: ...

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?k=1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_webhook_is_retried_with_backoff_until_it_is_taken(worker: RunningWorker) -> None:
    receiver = Receiver(failures=2)
    try:
        started = time.monotonic()
        reply = httpx.post(
            f"{worker.url}/v2/models/doubler/jobs",
            json=x_request(7.0),
            headers={"x-webhook-url": receiver.url},
        )
        location = reply.headers["location"]
        wait_for(
            lambda: (
                (httpx.get(worker.url + location).json().get("webhook") or {}).get("delivered")
                is True
            ),
            what="the webhook to be delivered",
        )
        elapsed = time.monotonic() - started
        document = httpx.get(worker.url + location).json()
        assert document["webhook"]["attempts"] == 3
        assert len(receiver.bodies) == 3
        # Each delivery carries the finished job, result and all.
        assert receiver.bodies[-1]["id"] == document["id"]
        assert receiver.bodies[-1]["result"]["outputs"][0]["data"] == [15.0]
        # Two waits: about 0.5 s, then about 1 s (each within 20%).
        assert elapsed >= 0.4 + 0.8
    finally:
        receiver.close()


def test_a_webhook_refused_for_good_is_not_retried(worker: RunningWorker) -> None:
    reply = httpx.post(
        f"{worker.url}/v2/models/doubler/jobs",
        json=x_request(1.0),
        headers={"x-webhook-url": f"{worker.url}/no/such/route"},  # the worker answers 404
    )
    location = reply.headers["location"]
    wait_for(
        lambda: (
            (httpx.get(worker.url + location).json().get("webhook") or {}).get("delivered") is False
        ),
        what="the webhook to be given up",
    )
    hook = httpx.get(worker.url + location).json()["webhook"]
    assert hook["attempts"] == 1
    assert "404" in hook["error"]


def test_a_submission_waits_while_the_worker_is_pressed_then_is_refused(
    worker: RunningWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The desk holds a submission while online requests need the loop (not refused into a
    retry at once), and refuses it with a Retry-After once it has waited its time."""
    polls = []

    def pressed(limit: int) -> bool:
        polls.append(1)
        return len(polls) <= limit

    body = orjson.dumps(x_request(1.0))

    async def submit(desk: JobDesk) -> dict[str, Any]:
        return await desk.submit(model="doubler", version=None, kind="v2", body=body)

    dataplane = worker.worker.dataplane
    patient = JobDesk(MemoryJobStore(), dataplane, pressed=lambda: pressed(3))
    document = asyncio.run(submit(patient))
    assert document["status"] == "queued" and len(polls) == 4  # three pressed looks, then in

    monkeypatch.setattr(desk_module, "SUBMIT_WAIT_S", 0.1)
    busy = JobDesk(MemoryJobStore(), dataplane, pressed=lambda: True)
    with pytest.raises(QueueFull) as refused:
        asyncio.run(submit(busy))
    assert refused.value.retry_after_s == 1.0
