"""ModelStreamInfer on a worker, spoken by an unchanged `tritonclient.grpc` (sync and aio):
requests pipelined on one stream, answered as they finish, errors per request."""

from __future__ import annotations

import asyncio
import queue
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from support.models import doubler_config, write_model
from support.servers import RunningWorker, free_port, run_worker, wait_for
from support.up import tailserve_up
from tailserve.protocols.grpc import schema
from tailserve.settings import Settings


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("stream-repo")
    write_model(repo, "doubler", doubler_config())
    write_model(repo, "slow", doubler_config(parameters={"delay": 0.5}, warmup={"repeat": 0}))
    return repo


@pytest.fixture(scope="module")
def worker(repository: Path) -> Iterator[tuple[RunningWorker, str]]:
    port = free_port()
    with run_worker(Settings(repository=str(repository), grpc_port=port)) as running:
        yield running, f"127.0.0.1:{port}"


def x_input(*values: float) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("x", [len(values), 1], "FP32")
    tensor.set_data_from_numpy(np.array(values, dtype=np.float32).reshape(-1, 1))
    return tensor


def test_the_stream_answer_is_the_protocols_message() -> None:
    theirs = service_pb2.DESCRIPTOR.message_types_by_name["ModelStreamInferResponse"]
    ours = schema.ModelStreamInferResponse.DESCRIPTOR
    assert [(f.name, f.number, f.type) for f in ours.fields] == [
        (f.name, f.number, f.type) for f in theirs.fields
    ]


def stream(address: str, sends: list[tuple[str, str, Any]]) -> list[tuple[Any, Any]]:
    """Each (model, request id, input) sent on one stream; the answers in the order they came,
    as (result, error)."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton_grpc.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for model, request_id, tensor in sends:
            client.async_stream_infer(model, [tensor], request_id=request_id)
        got = [answers.get(timeout=30) for _ in sends]
    finally:
        client.stop_stream()
        client.close()
    return got


def test_many_requests_pipelined_on_one_stream_are_each_answered(
    worker: tuple[RunningWorker, str],
) -> None:
    _, address = worker
    sends = [("doubler", f"r{i}", x_input(float(i))) for i in range(60)]
    got = stream(address, sends)
    assert all(error is None for _, error in got)
    by_id = {result.get_response().id: result.as_numpy("y") for result, _ in got}
    assert sorted(by_id) == sorted(f"r{i}" for i in range(60))
    for i in range(60):
        np.testing.assert_array_equal(by_id[f"r{i}"], [[2.0 * i + 1.0]])


def test_answers_come_as_they_finish_not_in_the_order_sent(
    worker: tuple[RunningWorker, str],
) -> None:
    _, address = worker
    got = stream(address, [("slow", "first", x_input(1.0)), ("doubler", "second", x_input(2.0))])
    assert [result.get_response().id for result, _ in got] == ["second", "first"]


def test_an_error_answers_its_request_and_the_stream_goes_on(
    worker: tuple[RunningWorker, str],
) -> None:
    _, address = worker
    wrong = triton_grpc.InferInput("nope", [1, 1], "FP32")
    wrong.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
    got = stream(
        address,
        [
            ("doubler", "bad", wrong),
            ("nosuch", "lost", x_input(1.0)),
            ("doubler", "good", x_input(3.0)),
        ],
    )
    errors = sorted(str(error) for _, error in got if error is not None)
    assert len(errors) == 2
    assert any("no input named 'nope'" in e for e in errors)
    assert any("nosuch" in e for e in errors)
    results = [result for result, error in got if error is None]
    assert [r.get_response().id for r in results] == ["good"]
    np.testing.assert_array_equal(results[0].as_numpy("y"), [[7.0]])


async def test_the_aio_client_streams_too(worker: tuple[RunningWorker, str]) -> None:
    _, address = worker
    client = triton_aio.InferenceServerClient(address)

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i in range(20):
            tensor = triton_aio.InferInput("x", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[float(i)]], dtype=np.float32))
            yield {"model_name": "doubler", "inputs": [tensor], "request_id": f"a{i}"}

    seen = {}
    try:
        async for result, error in client.stream_infer(requests()):
            assert error is None
            seen[result.get_response().id] = float(result.as_numpy("y")[0, 0])
            if len(seen) == 20:
                break
    finally:
        await client.close()
    assert seen == {f"a{i}": 2.0 * i + 1.0 for i in range(20)}


async def test_a_client_that_leaves_cancels_what_it_left_in_flight(
    worker: tuple[RunningWorker, str],
) -> None:
    running, address = worker
    client = triton_aio.InferenceServerClient(address)
    sent = asyncio.Event()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        tensor = triton_aio.InferInput("x", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
        yield {"model_name": "slow", "inputs": [tensor], "request_id": "left"}
        sent.set()
        await asyncio.Event().wait()  # the client's side stays open

    call = client.stream_infer(requests())
    reading = asyncio.ensure_future(call.__anext__())
    await sent.wait()

    def held() -> bool:  # the stream's request, beside this scrape
        page = httpx.get(f"{running.url}/metrics").text
        found = re.search(r"^tailserve_requests_in_flight (\S+)$", page, re.MULTILINE)
        return found is not None and float(found.group(1)) >= 2

    await asyncio.to_thread(wait_for, held, 10.0, "the request to be in flight")
    reading.cancel()
    await client.close()
    # Counted as nginx counts a client gone before its answer: 499.
    left = 'tailserve_requests_total{model="slow",protocol="grpc",status="499"} 1.0'
    await asyncio.to_thread(
        wait_for, lambda: left in httpx.get(f"{running.url}/metrics").text, 10.0, "a 499"
    )


def test_a_stream_goes_through_the_front_door_as_grpc_with_its_deadline(
    repository: Path, tmp_path: Path
) -> None:
    port = free_port()
    with tailserve_up(repository, tmp_path, "--workers", "2", "--grpc-port", str(port)) as up:
        address = f"127.0.0.1:{port}"
        got = stream(address, [("doubler", f"d{i}", x_input(float(i))) for i in range(10)])
        answered = sorted(result.get_response().id for result, error in got if error is None)
        assert answered == sorted(f"d{i}" for i in range(10))
        # The call's gRPC deadline reaches the worker through the front door as the request's
        # own: once the slow model's cost is known (0.5 s a batch, on every worker), a 100 ms
        # call is refused at admission (429) rather than run for a client that has gone.
        client = triton_grpc.InferenceServerClient(address)
        try:
            workers = set(up.worker_pids())

            def each_worker_ran_one() -> bool:
                client.infer("slow", [x_input(1.0)])
                page = httpx.get(f"{up.url}/metrics").text.splitlines()
                ran = [
                    line
                    for line in page
                    if line.startswith("tailserve_requests_total{")
                    and 'model="slow"' in line
                    and 'status="200"' in line
                ]
                return all(any(f'worker="{w}"' in line for line in ran) for w in workers)

            wait_for(each_worker_ran_one, what="each worker to learn the slow model's cost")
            with pytest.raises(InferenceServerException):
                client.infer("slow", [x_input(1.0)], client_timeout=0.1)
        finally:
            client.close()
        refused = 'model="slow",protocol="grpc",status="429"'
        wait_for(
            lambda: refused in httpx.get(f"{up.url}/metrics").text,
            what="the worker's refusal of the call",
        )
