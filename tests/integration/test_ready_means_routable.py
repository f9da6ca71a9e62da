"""Ready means routable, measured as an orchestrator meets it: `tailserve up` probed from the
moment it starts, and every kind of request sent at the first instant its front door says
ready (HTTP inference, a job, gRPC unary and a stream); a request that finds no worker up
waits for one within its deadline."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as triton_grpc

from support.churn import grpc_inputs
from support.servers import free_port, wait_for
from support.up import STARTED, UpProcess, tailserve_up
from tailserve.examples.churn import FIELDS, sample_rows


def first_ready(client: httpx.Client, up: UpProcess, timeout: float = 90.0) -> None:
    """Probe the front door's ready route as fast as a client would, until it says 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert up.process.poll() is None, up.log()
        with contextlib.suppress(httpx.HTTPError):
            if client.get(f"{up.url}/v2/health/ready").status_code == 200:
                return
    raise AssertionError(f"the front door never said ready:\n{up.log()}")


def churn_body() -> dict[str, object]:
    sample = sample_rows(1, 3)
    return {
        "inputs": [
            {"name": f.name, "datatype": f.datatype, "shape": [1, 1], "data": sample[f.name]}
            for f in FIELDS
        ]
    }


@pytest.mark.timeout(180)
def test_every_request_sent_at_the_first_ready_is_served(
    churn_repository: Path, tmp_path: Path
) -> None:
    grpc_port = free_port()
    with (
        tailserve_up(
            churn_repository,
            tmp_path,
            "--workers",
            "2",
            "--grpc-port",
            str(grpc_port),
            wait_ready=False,
        ) as up,
        httpx.Client(timeout=30) as client,
    ):
        first_ready(client, up)
        body = churn_body()
        statuses = []
        for _ in range(20):
            statuses.append(client.post(f"{up.url}/v2/models/churn/infer", json=body).status_code)
        job = client.post(f"{up.url}/v2/models/churn/jobs", json=body)
        grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert grpc.is_server_ready()
            assert grpc.is_model_ready("churn")
            reply = grpc.infer("churn", grpc_inputs(1))
            answers: queue.Queue[object] = queue.Queue()
            grpc.start_stream(callback=lambda result, error: answers.put(error or result))
            grpc.async_stream_infer("churn", grpc_inputs(1))
            streamed = answers.get(timeout=20)
            grpc.stop_stream()
        finally:
            grpc.close()
    assert statuses == [200] * 20
    assert job.status_code == 202, job.text
    assert reply.as_numpy("churn_probability").shape == (1, 1)
    assert isinstance(streamed, triton_grpc.InferResult), streamed


@pytest.mark.timeout(180)
def test_a_request_with_no_worker_up_waits_for_one_within_its_deadline(
    churn_repository: Path, tmp_path: Path
) -> None:
    with (
        tailserve_up(churn_repository, tmp_path, "--workers", "1", wait_ready=False) as up,
        httpx.Client(timeout=30) as client,
    ):
        first_ready(client, up)
        (pid,) = [int(p) for name, p, _ in STARTED.findall(up.log()) if name == "worker-0"]
        os.kill(pid, signal.SIGKILL)
        # The front door has seen it go: not ready, and nothing up to send a request to.
        wait_for(
            lambda: client.get(f"{up.url}/v2/health/ready").status_code == 503,
            timeout=10,
            what="the front door to see its only worker gone",
        )
        reply = client.post(
            f"{up.url}/v2/models/churn/infer",
            json=churn_body(),
            headers={"X-Deadline-Ms": "20000"},
        )
        assert reply.status_code == 200, reply.text
        assert len(STARTED.findall(up.log())) == 2  # answered by the worker started again
