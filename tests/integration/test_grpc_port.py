"""The worker's gRPC port at its edges, as grpcio's clients meet it: a message over the size
limit, more unanswered calls on a connection than it may hold, a stop with calls in flight."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from support.models import doubler_config, write_model
from support.servers import RunningWorker, free_port, run_worker, wait_for
from tailserve.protocols.grpc import schema
from tailserve.settings import Settings

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("grpc-port-repo")
    write_model(repo, "doubler", doubler_config(max_batch_size=100_000))
    write_model(repo, "slow", doubler_config(parameters={"delay": 0.5}, warmup={"repeat": 0}))
    write_model(repo, "slower", doubler_config(parameters={"delay": 2.0}, warmup={"repeat": 0}))
    return repo


@pytest.fixture
def worker(repository: Path) -> Iterator[tuple[RunningWorker, str]]:
    port = free_port()
    settings = Settings(repository=str(repository), grpc_port=port, max_body_bytes=LIMIT)
    with run_worker(settings) as running:
        yield running, f"127.0.0.1:{port}"


def request(model: str, rows: int) -> Any:
    message = schema.ModelInferRequest(model_name=model)
    message.inputs.add(name="x", datatype="FP32", shape=[rows, 1])
    message.raw_input_contents.append(np.arange(rows, dtype=np.float32).tobytes())
    return message


def infer(channel: grpc.Channel, message: Any, timeout: float = 30) -> Any:
    call = channel.unary_unary(
        f"/{schema.SERVICE}/ModelInfer",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=schema.ModelInferResponse.FromString,
    )
    return call(message, timeout=timeout)


def test_a_message_over_the_limit_is_refused_and_the_port_serves_on(
    worker: tuple[RunningWorker, str],
) -> None:
    _, address = worker
    big = request("doubler", LIMIT // 4 + 100)  # (4 bytes a row)
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as unary:
            infer(channel, big)
        assert unary.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than the limit" in unary.value.details()

        stream = channel.stream_stream(
            f"/{schema.SERVICE}/ModelStreamInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=schema.ModelStreamInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as streamed:
            list(stream(iter([request("doubler", 3), big]), timeout=30))
        assert streamed.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

        answer = infer(channel, request("doubler", 3))
    values = np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)
    np.testing.assert_array_equal(values, [1.0, 3.0, 5.0])


def test_calls_past_what_a_connection_may_hold_are_refused_and_the_others_answered(
    worker: tuple[RunningWorker, str],
) -> None:
    running, address = worker
    server = running.worker._grpc
    assert server is not None
    padded = request("slower", 1)
    padded.id = "p" * (LIMIT - 4096)  # (four such calls fit in the hold, 4 x LIMIT; five do not)
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{schema.SERVICE}/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=schema.ModelInferResponse.FromString,
        )
        held = [call.future(padded, timeout=30) for _ in range(4)]
        wait_for(lambda: server.streams == 4, 10.0, "four calls in flight")
        with pytest.raises(grpc.RpcError) as crowded:
            infer(channel, padded)
        assert crowded.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"hold more than {4 * LIMIT} bytes" in crowded.value.details()
        answers = [future.result() for future in held]
        assert [answer.id for answer in answers] == [padded.id] * 4


def test_a_stop_answers_the_calls_in_flight(worker: tuple[RunningWorker, str]) -> None:
    running, address = worker
    answers: list[Any] = []
    client = triton_grpc.InferenceServerClient(address)
    tensor = triton_grpc.InferInput("x", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    call = threading.Thread(target=lambda: answers.append(client.infer("slow", [tensor])))
    call.start()
    server = running.worker._grpc
    assert server is not None
    wait_for(lambda: server.streams == 1, 10.0, "the call to be in flight")
    running.worker.request_exit()  # as SIGTERM does
    call.join(timeout=30)
    client.close()
    (answer,) = answers
    np.testing.assert_array_equal(answer.as_numpy("y"), [[9.0]])
