"""Unary gRPC calls over HTTP/1.1 on the worker's HTTP port, as the front door forwards them
(`protocols.grpc.over_http1`), read off the wire: the message framed as gRPC frames it, the
status as a trailer of a chunked reply; an error "trailers-only", its status in the headers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from support.models import doubler_config, write_model
from support.servers import RunningWorker, run_worker
from tailserve.protocols.grpc import schema
from tailserve.settings import Settings

PATH = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    repository = tmp_path_factory.mktemp("repository")
    write_model(repository, "doubler", doubler_config())
    with run_worker(Settings(repository=str(repository))) as running:
        yield running


class Answer:
    def __init__(self, raw: bytes) -> None:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = dict(_field(line) for line in lines[1:])
        self.body = b""
        self.trailers: dict[bytes, bytes] = {}
        if self.headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                if size == 0:
                    break
                self.body += rest[:size]
                rest = rest[size + 2 :]
            trailer_block = rest.split(b"\r\n\r\n")[0]
            self.trailers = dict(_field(line) for line in trailer_block.split(b"\r\n") if line)
        else:
            self.body = rest[: int(self.headers[b"content-length"])]

    def message(self) -> bytes:
        assert self.body[0] == 0 and int.from_bytes(self.body[1:5], "big") == len(self.body) - 5
        return self.body[5:]


def _field(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.strip().lower(), value.strip()


def call(
    worker: RunningWorker,
    method: str,
    message: bytes,
    *,
    framed: bytes | None = None,
    headers: tuple[str, ...] = (),
    content_type: str = "application/grpc",
) -> Answer:
    body = framed if framed is not None else b"\0" + len(message).to_bytes(4, "big") + message
    head = [
        f"POST {PATH}{method} HTTP/1.1",
        "host: worker",
        f"content-type: {content_type}",
        "te: trailers",
        f"content-length: {len(body)}",
        "connection: close",
        *headers,
    ]
    with socket.create_connection(("127.0.0.1", worker.port), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    return Answer(raw)


def infer_request(values: list[float], model: str = "doubler") -> bytes:
    request = schema.ModelInferRequest(model_name=model, id="r1")
    tensor = request.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend([len(values), 1])
    request.raw_input_contents.append(np.array(values, dtype=np.float32).tobytes())
    return bytes(request.SerializeToString())


def test_an_inference_is_answered_with_its_message_then_an_ok_trailer(
    worker: RunningWorker,
) -> None:
    answer = call(worker, "ModelInfer", infer_request([1.5, -2.0]))
    assert answer.status == 200
    assert answer.headers[b"content-type"] == b"application/grpc"
    assert b"grpc-status" not in answer.headers
    assert answer.trailers[b"grpc-status"] == b"0"
    response = schema.ModelInferResponse.FromString(answer.message())
    assert (response.model_name, response.id) == ("doubler", "r1")
    (output,) = response.outputs
    assert output.name == "y" and list(output.shape) == [2, 1]
    got = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    assert got.tolist() == [4.0, -3.0]  # 2x + 1 (the version)


def test_health_and_metadata_calls_are_answered_too(worker: RunningWorker) -> None:
    ready = call(worker, "ServerReady", b"")
    assert ready.trailers[b"grpc-status"] == b"0"
    assert schema.ServerReadyResponse.FromString(ready.message()).ready is True
    request = schema.ModelMetadataRequest(name="doubler").SerializeToString()
    metadata = call(worker, "ModelMetadata", bytes(request))
    assert schema.ModelMetadataResponse.FromString(metadata.message()).inputs[0].name == "x"


def test_an_error_is_answered_trailers_only_with_the_http_surfaces_message(
    worker: RunningWorker,
) -> None:
    answer = call(worker, "ModelInfer", infer_request([1.0], model="absent"))
    assert answer.status == 200 and answer.body == b""
    assert answer.headers[b"grpc-status"] == b"5"  # NOT_FOUND
    assert b"absent" in answer.headers[b"grpc-message"]
    assert answer.trailers == {}


@pytest.mark.parametrize(
    ("method", "framed", "code", "words"),
    [
        ("ModelInfer", b"\0\0\0\0\x09abc", b"13", b"not one gRPC message"),
        ("ModelInfer", b"\1\0\0\0\x01a", b"12", b"compressed"),
        ("ModelInfer", b"\0\0\0\0\x03\xff\xff\xff", b"3", b"not a valid ModelInferRequest"),
        ("Unheard", b"\0\0\0\0\0", b"12", b"no such method"),
    ],
)
def test_a_call_that_cannot_be_read_gets_a_status_that_says_why(
    worker: RunningWorker, method: str, framed: bytes, code: bytes, words: bytes
) -> None:
    answer = call(worker, method, b"", framed=framed)
    assert answer.status == 200
    assert answer.headers[b"grpc-status"] == code
    assert words in answer.headers[b"grpc-message"]


def test_grpc_timeout_is_the_calls_deadline(worker: RunningWorker) -> None:
    # 1 ns: no batch can meet it, refused before any work as over grpcio's server.
    answer = call(worker, "ModelInfer", infer_request([1.0]), headers=("grpc-timeout: 1n",))
    assert answer.headers[b"grpc-status"] == b"8", answer.headers  # RESOURCE_EXHAUSTED
    assert b"deadline" in answer.headers[b"grpc-message"]
    roomy = call(worker, "ModelInfer", infer_request([1.0]), headers=("grpc-timeout: 5S",))
    assert roomy.trailers[b"grpc-status"] == b"0"
    bad = call(worker, "ModelInfer", infer_request([1.0]), headers=("grpc-timeout: soon",))
    assert bad.headers[b"grpc-status"] == b"13"
    assert b"not a gRPC timeout" in bad.headers[b"grpc-message"]


def test_a_request_that_is_not_grpc_is_refused_by_its_content_type(worker: RunningWorker) -> None:
    answer = call(worker, "ModelInfer", b"", content_type="application/json")
    assert answer.status == 415
    assert b"application/grpc" in answer.body
