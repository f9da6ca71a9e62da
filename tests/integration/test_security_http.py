"""Security of a real worker on loopback: errors that quote what was sent in plain words,
size limits refused before anything is allocated (HTTP and gRPC), path traversal in model
names refused, and slow clients timed out while an idle kept-alive connection is not."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from support.models import doubler_config, write_model
from support.servers import RunningWorker, free_port, run_worker
from tailserve.settings import Settings

LIMIT = 64 * 1024
ONE = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    repository = tmp_path_factory.mktemp("repository")
    write_model(repository, "m", doubler_config(cache={"enabled": True}))
    (repository / "outside").mkdir()
    settings = Settings(
        repository=str(repository),
        max_body_bytes=LIMIT,
        grpc_port=free_port(),
        head_timeout_s=1.0,
        read_timeout_s=1.5,
        keep_alive_s=4.0,
    )
    with run_worker(settings) as running:
        yield running


def _infer(worker: RunningWorker, *, model: str = "m", **kwargs: object) -> httpx.Response:
    return httpx.post(f"{worker.url}/v2/models/{model}/infer", **kwargs)  # type: ignore[arg-type]


# --- errors never echo raw bytes -------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-Deadline-Ms": "abc"}, "X-Deadline-Ms must be a positive number of milliseconds"),
        ({"X-Priority": "-5"}, "X-Priority (the 'priority' option) must be a whole number in 1.."),
        ({"X-Priority": "first"}, "X-Priority must be a whole number: 1 is the highest level"),
        ({"X-Cache-Mode": "sometimes"}, "X-Cache-Mode must be one of use, bypass, refresh"),
        ({"Inference-Header-Content-Length": "x"}, "a whole number of bytes, got 'x'"),
    ],
)
def test_bad_headers_are_400s_in_plain_words(
    worker: RunningWorker, headers: dict[str, str], expected: str
) -> None:
    reply = _infer(worker, json=ONE, headers=headers)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]
    assert expected in message
    assert "b'" not in message and 'b"' not in message


def test_a_long_or_binary_header_value_is_cut_and_decoded(worker: RunningWorker) -> None:
    raw = b"\xff\xfe" + b"9" * 5000
    reply = _infer(worker, json=ONE, headers=[(b"x-deadline-ms", raw)])
    assert reply.status_code == 400
    message = reply.json()["error"]
    assert "(cut to 64 characters)" in message and "9" * 100 not in message
    assert "\\xff" not in message and "b'" not in message


# --- sizes ----------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_naming_the_limit(worker: RunningWorker) -> None:
    data = [1.0] * (LIMIT // 3)  # JSON of ~4 bytes a value: over the limit
    reply = _infer(worker, json={"inputs": [{**ONE["inputs"][0], "data": data}]})
    assert reply.status_code == 413
    assert f"over the {LIMIT}-byte limit" in reply.json()["error"]


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ([10**9, 10**9], "is too large: its dimensions may multiply to at most 2**58 elements"),
        ([10**8, 1], "needs 100000000 elements, data has 1"),
    ],
)
def test_a_huge_declared_shape_is_refused_without_allocating(
    worker: RunningWorker, shape: list[int], expected: str
) -> None:
    tensor = {"name": "x", "datatype": "FP32", "shape": shape, "data": [1.0]}
    reply = _infer(worker, json={"inputs": [tensor]})
    assert reply.status_code == 400
    assert expected in reply.json()["error"]


def test_a_binary_tensor_whose_shape_outgrows_its_bytes_is_refused(worker: RunningWorker) -> None:
    header = (
        b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1000000000,1000],'
        b'"parameters":{"binary_data_size":4}}]}'
    )
    reply = _infer(
        worker,
        content=header + np.float32(1).tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert reply.status_code == 400
    assert "needs 4000000000000 bytes, got 4" in reply.json()["error"]


def test_grpc_refuses_a_message_over_the_limit_and_a_huge_shape(worker: RunningWorker) -> None:
    address = f"127.0.0.1:{worker.worker.settings.grpc_port}"
    client = triton_grpc.InferenceServerClient(address)
    big = triton_grpc.InferInput("x", [LIMIT, 1], "FP32")
    big.set_data_from_numpy(np.ones((LIMIT, 1), np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("m", [big])
    assert caught.value.status() == str(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert str(LIMIT) in caught.value.message()
    huge = triton_grpc.InferInput("x", [10**9, 10**9], "FP32")
    huge._get_tensor().contents.fp32_contents.append(1.0)  # the data a client could lie about
    with pytest.raises(InferenceServerException) as caught:
        client.infer("m", [huge])
    assert caught.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert "too large" in caught.value.message()
    client.close()


# --- path traversal --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/..%2F..%2Fetc/infer",
        "/v2/models/../infer",
        "/v2/models/%2Fetc%2Fpasswd/infer",
        "/v2/models/m%00/infer",
        "/v2/repository/models/..%2Foutside/load",
        "/v2/repository/models/../load",
        "/v2/repository/models/outside/load",  # a folder of the repository, with no model.yaml
        "/v2/repository/models/%2Ftmp/load",
        "/v2/repository/models/m%00/load",
    ],
)
def test_model_names_that_climb_out_of_the_repository_are_refused(
    worker: RunningWorker, path: str
) -> None:
    reply = httpx.post(f"{worker.url}{path}", json=ONE)
    assert reply.status_code in (400, 404), (path, reply.status_code, reply.text)
    assert reply.json()["error"]
    # The repository still serves its model, loaded as it was.
    assert _infer(worker, json=ONE).status_code == 200


# --- slow clients ----------------------------------------------------------------------------


def _connect(worker: RunningWorker) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", worker.port), timeout=10)
    return sock


def _dribble(sock: socket.socket, data: bytes, until: float) -> bytes:
    """Send ``data`` a byte every 0.1 s until the server answers (or ``until``)."""
    sock.settimeout(0.1)
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            if time.monotonic() > until:
                break
            continue
        return answer + _read_all(sock)
    return _read_all(sock)


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_client_trickling_its_head_is_cut_off_at_the_head_timeout(
    worker: RunningWorker,
) -> None:
    began = time.monotonic()
    with _connect(worker) as sock:
        head = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: w\r\nx-slow: " + b"v" * 200
        answer = _dribble(sock, head, until=began + 10)
    took = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request head not received within 1 s" in answer
    assert took < 4, took  # the head timeout (1 s) and the once-a-second sweep
    assert _infer(worker, json=ONE).status_code == 200


def test_a_body_that_stops_coming_is_cut_off_at_the_body_timeout(worker: RunningWorker) -> None:
    began = time.monotonic()
    with _connect(worker) as sock:
        sock.sendall(
            b"POST /v2/models/m/infer HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n{"
        )
        answer = _read_all(sock)
    took = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request body stalled: nothing received for 1.5 s" in answer
    assert 1.4 < took < 4, took


def test_an_idle_kept_alive_connection_keeps_its_own_longer_timeout(
    worker: RunningWorker,
) -> None:
    request = b"GET /v2/health/live HTTP/1.1\r\nhost: w\r\n\r\n"
    with _connect(worker) as sock:
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        # Idle past the head and body timeouts, within keep_alive_s (4 s): still open.
        time.sleep(2.5)
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        assert sock.recv(65536) == b""  # closed by the server once idle for keep_alive_s
        took = time.monotonic() - began
    assert 3.5 < took < 7, took
