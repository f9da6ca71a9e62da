"""The OIP v2 REST surface of a real worker on loopback, with python-runtime test models."""

from __future__ import annotations

import concurrent.futures
import gzip
import re
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from support.models import doubler_config, write_model
from support.servers import RunningWorker, run_worker
from tailserve.protocols.http import binary_layouts, oip, oip_typed
from tailserve.protocols.http.routes import ROUTES
from tailserve.settings import Settings

ECHO = """
import numpy as np

class Model:
    def predict(self, inputs):
        return {"text_out": inputs["text"], "half_out": inputs["half"].astype(np.float16)}
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "doubler", doubler_config(version_policy={"all": True}), versions=(1, 2))
    write_model(
        repo,
        "slow",
        doubler_config(
            parameters={"delay": 0.3},
            batching={"max_queue_size": 2, "max_queue_delay_ms": 0},
            warmup={"batch_sizes": [1], "repeat": 0},
        ),
    )
    write_model(
        repo,
        "echo",
        {
            "runtime": "python",
            "max_batch_size": 8,
            "inputs": [
                {"name": "text", "datatype": "BYTES", "shape": [1]},
                {"name": "half", "datatype": "FP16", "shape": [2]},
            ],
            "outputs": [
                {"name": "text_out", "datatype": "BYTES", "shape": [1]},
                {"name": "half_out", "datatype": "FP16", "shape": [2]},
            ],
        },
        code=ECHO,
    )
    write_model(repo, "broken", doubler_config(parameters={"fail_load": True}))
    settings = Settings(repository=str(repo), max_body_bytes=4096, admin_token="s3cret")
    with run_worker(settings) as running:
        yield running


def one_input(datatype: str, shape: list[int], data: list[float]) -> dict[str, Any]:
    return {"json": {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}}


def infer_body(values: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(values), 1], "data": values}],
        **extra,
    }


def assert_still_serving(url: str) -> None:
    reply = httpx.post(f"{url}/v2/models/doubler/infer", json=infer_body([1.0]))
    assert reply.status_code == 200, reply.text


def test_health_and_server_metadata(worker: RunningWorker) -> None:
    assert httpx.get(f"{worker.url}/v2/health/live").status_code == 200
    # 'broken' failed to load: reported, but the others serve and the server is ready.
    assert httpx.get(f"{worker.url}/v2/health/ready").status_code == 200
    meta = httpx.get(f"{worker.url}/v2").json()
    assert meta["name"] == "tailserve"
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata_marks_the_batch_dimension_variable(worker: RunningWorker) -> None:
    meta = httpx.get(f"{worker.url}/v2/models/doubler").json()
    assert meta["name"] == "doubler"
    assert meta["versions"] == ["1", "2"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 1]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}]
    versioned = httpx.get(f"{worker.url}/v2/models/doubler/versions/1").json()
    assert versioned["inputs"] == meta["inputs"]
    config = httpx.get(f"{worker.url}/v2/models/doubler/config").json()
    assert config["max_batch_size"] == 16


def test_model_readiness(worker: RunningWorker) -> None:
    assert httpx.get(f"{worker.url}/v2/models/doubler/ready").status_code == 200
    assert httpx.get(f"{worker.url}/v2/models/doubler/versions/2/ready").status_code == 200
    assert httpx.get(f"{worker.url}/v2/models/doubler/versions/7/ready").status_code == 400
    broken = httpx.get(f"{worker.url}/v2/models/broken/ready")
    assert broken.status_code == 400
    assert broken.json()["ready"] is False
    assert httpx.get(f"{worker.url}/v2/models/nope/ready").status_code == 404


def test_json_infer_answers_each_row_and_says_how_it_was_served(worker: RunningWorker) -> None:
    reply = httpx.post(
        f"{worker.url}/v2/models/doubler/infer", json=infer_body([1.0, 2.5], id="req-1")
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model_name"] == "doubler"
    assert body["model_version"] == "2"  # the latest version serves by default
    assert body["id"] == "req-1"
    assert body["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [2, 1], "data": [4.0, 7.0]}
    ]
    params = body["parameters"]
    assert params["batch_size"] >= 2
    assert params["queue_us"] >= 0 and params["compute_us"] >= 0
    assert params["cost_class"] == "all"  # a model with one class
    assert reply.headers["x-batch-size"] == str(params["batch_size"])
    assert reply.headers["x-queue-us"] == str(params["queue_us"])


def test_versioned_infer_runs_that_version(worker: RunningWorker) -> None:
    reply = httpx.post(f"{worker.url}/v2/models/doubler/versions/1/infer", json=infer_body([1.0]))
    assert reply.json()["outputs"][0]["data"] == [3.0]
    assert reply.json()["model_version"] == "1"


def test_binary_request_and_binary_response(worker: RunningWorker) -> None:
    values = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [3, 1],
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    )
    reply = httpx.post(
        f"{worker.url}/v2/models/doubler/infer",
        content=header + values.tobytes(),
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
    )
    assert reply.status_code == 200, reply.text
    length = int(reply.headers["inference-header-content-length"])
    head = orjson.loads(reply.content[:length])
    output = head["outputs"][0]
    assert output["parameters"]["binary_data_size"] == 12
    data = np.frombuffer(reply.content[length:], dtype="<f4")
    np.testing.assert_array_equal(data, [4.0, 6.0, 8.0])


def test_binary_requests_under_a_header_met_before_answer_from_their_own_bytes(
    worker: RunningWorker,
) -> None:
    # The first two requests under a header are read the general way and the header kept; the
    # next ones are read by it (http/binary_layouts.py): each answered from its own bytes, and
    # bytes that do not fit the header refused in the general way's words.
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [2, 1],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    )

    def post(content: bytes) -> httpx.Response:
        return httpx.post(
            f"{worker.url}/v2/models/doubler/infer",
            content=content,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )

    for n in range(5):
        values = np.array([[n], [n + 0.5]], dtype=np.float32)
        reply = post(header + values.tobytes())
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["data"] == (values * 2 + 2).ravel().tolist()
    served = worker.worker.dataplane.serving("doubler", None)
    assert served is not None
    reader = binary_layouts.reader_for(served.config, served.plan)
    assert reader is not None and reader.keeps(header)
    short = post(header + b"\x00" * 4)
    assert short.status_code == 400
    assert "binary_data_size 8 runs past the binary data (4 bytes left)" in short.json()["error"]
    longer = post(header + b"\x00" * 12)
    assert longer.status_code == 400
    assert "4 bytes of binary data follow the header that no input claims" in longer.text
    assert post(header + np.float32([[1], [2]]).tobytes()).json()["outputs"][0]["data"] == [4, 6]


def test_bytes_and_fp16_tensors_round_trip_json_and_binary(worker: RunningWorker) -> None:
    texts = ["monthly", "année ✓"]
    half = np.array([[0.5, 1.5], [2.0, -1.0]], dtype=np.float16)
    body = {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": texts},
            {"name": "half", "datatype": "FP16", "shape": [2, 2], "data": half.ravel().tolist()},
        ]
    }
    reply = httpx.post(f"{worker.url}/v2/models/echo/infer", json=body)
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o for o in reply.json()["outputs"]}
    assert outputs["text_out"]["data"] == texts
    assert outputs["half_out"]["data"] == [0.5, 1.5, 2.0, -1.0]
    assert outputs["half_out"]["datatype"] == "FP16"

    encoded = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [2, 1],
                    "parameters": {"binary_data_size": len(encoded)},
                },
                {
                    "name": "half",
                    "datatype": "FP16",
                    "shape": [2, 2],
                    "parameters": {"binary_data_size": half.nbytes},
                },
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    reply = httpx.post(
        f"{worker.url}/v2/models/echo/infer",
        content=header + encoded + half.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert reply.status_code == 200, reply.text
    length = int(reply.headers["inference-header-content-length"])
    head = orjson.loads(reply.content[:length])
    sizes = [o["parameters"]["binary_data_size"] for o in head["outputs"]]
    raw = reply.content[length:]
    assert raw[: sizes[0]] == encoded
    np.testing.assert_array_equal(np.frombuffer(raw[sizes[0] :], dtype="<f2").reshape(2, 2), half)


def test_concurrent_requests_share_batches_and_get_their_own_rows(worker: RunningWorker) -> None:
    def call(i: int) -> tuple[list[float], int]:
        reply = httpx.post(
            f"{worker.url}/v2/models/doubler/infer", json=infer_body([float(i), float(i) + 0.5])
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        return body["outputs"][0]["data"], body["parameters"]["batch_size"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(64)))
    for i, (data, _) in enumerate(results):
        assert data == [2 * i + 2.0, 2 * i + 3.0]
    # With a 2 ms window and 16 senders, some requests must have shared a batch.
    assert max(size for _, size in results) > 2


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "message"),
    [
        ("/v2/models/doubler/infer", {"content": b"{not json"}, 400, "not valid JSON"),
        ("/v2/models/doubler/infer", {"json": {"inputs": "x"}}, 400, "inputs"),
        ("/v2/models/doubler/infer", {"json": {"outputs": []}}, 400, "inputs"),
        (
            "/v2/models/doubler/infer",
            {
                "json": {
                    "inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 1], "data": [1]}]
                }
            },
            400,
            "datatype INT64 does not match the model's FP32",
        ),
        (
            "/v2/models/doubler/infer",
            {
                "json": {
                    "inputs": [
                        {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}
                    ]
                }
            },
            400,
            "shape [1, 3] does not match the model's [-1, 1]",
        ),
        (
            "/v2/models/doubler/infer",
            one_input("FP32", [2, 1], [1]),
            400,
            "needs 2 elements",
        ),
        ("/v2/models/doubler/infer", {"json": infer_body([1.0] * 17)}, 400, "1 to 16 rows, got 17"),
        (
            "/v2/models/doubler/infer",
            {"json": infer_body([1.0], outputs=[{"name": "z"}])},
            400,
            "no output named 'z'",
        ),
        ("/v2/models/doubler/infer", {"content": b"[" * 5000}, 413, "over the 4096-byte limit"),
        ("/v2/models/nope/infer", {"json": infer_body([1.0])}, 404, "unknown model 'nope'"),
        ("/v2/models/doubler/versions/9/infer", {"json": infer_body([1.0])}, 404, "no version 9"),
        ("/v2/models/broken/infer", {"json": infer_body([1.0])}, 503, "refuses to load"),
        ("/v2/nothing", {"json": {}}, 404, "no such route"),
        (
            "/v2/models/doubler/infer",
            {"content": b"{}", "headers": {"Inference-Header-Content-Length": "99"}},
            400,
            "does not fit a body",
        ),
        # Found by review: each of these was a 500.
        ("/v2/models/doubler/infer", one_input("FP32", [0, 2**62], []), 400, "is too large"),
        ("/v2/models/doubler/infer", one_input("FP32", [1] * 65, [1]), 400, "more than 32"),
        (
            "/v2/models/doubler/infer",
            {"content": b'{"inputs":[],"parameters":{"a":' + b"[" * 1100 + b"]" * 1100 + b"}}"},
            400,
            "nested too deeply",
        ),
        (
            "/v2/models/doubler/infer",
            {"content": orjson.dumps(infer_body([1.0])).replace(b'"x"', b'"\xff"')},
            400,
            "UTF-8",  # (msgspec 0.23 says "Invalid UTF-8 encoded string", 0.22 "not valid UTF-8")
        ),
        # ... and these were taken wrongly.
        (
            "/v2/models/doubler/infer",
            {"json": {**infer_body([1.0]), "parameters": {"binary_data_output": "false"}}},
            400,
            "'binary_data_output' must be true or false, not 'false'",
        ),
        (
            "/v2/models/doubler/infer",
            {
                "content": gzip.compress(orjson.dumps(infer_body([1.0])))[:-8],
                "headers": {"Content-Encoding": "gzip"},
            },
            400,
            "not valid gzip data: it is cut short",
        ),
    ],
)
def test_bad_requests_get_a_named_error_and_the_server_keeps_serving(
    worker: RunningWorker, path: str, kwargs: dict[str, Any], status: int, message: str
) -> None:
    # The interpreter's own recursion limit (a test run before, as hypothesis's, may leave it
    # raised; this worker shares the test's interpreter).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        reply = httpx.post(f"{worker.url}{path}", **kwargs)
    finally:
        sys.setrecursionlimit(limit)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]
    assert_still_serving(worker.url)


def test_wrong_method_is_405(worker: RunningWorker) -> None:
    reply = httpx.get(f"{worker.url}/v2/models/doubler/infer")
    assert reply.status_code == 405
    assert "error" in reply.json()


def test_full_queue_answers_503_with_retry_after(worker: RunningWorker) -> None:
    def call(_: int) -> httpx.Response:
        return httpx.post(f"{worker.url}/v2/models/slow/infer", json=infer_body([1.0]), timeout=30)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(call, range(12)))
    statuses = sorted(r.status_code for r in replies)
    assert 200 in statuses and 503 in statuses, statuses
    refused = next(r for r in replies if r.status_code == 503)
    assert refused.headers["retry-after"] == "1"
    assert "queue is full" in refused.json()["error"]
    assert_still_serving(worker.url)


def test_openapi_covers_every_route(worker: RunningWorker) -> None:
    document = httpx.get(f"{worker.url}/openapi.json").json()
    assert document["openapi"].startswith("3.")
    for route in ROUTES:
        assert route.method.lower() in document["paths"][route.template], route.template


def test_every_route_has_a_handler_of_its_name(worker: RunningWorker) -> None:
    handlers = worker.worker.app.handlers
    assert set(handlers) == {route.handler for route in ROUTES}
    for name, handler in handlers.items():
        assert handler.__name__ == f"_{name}"


def test_metrics_are_prometheus_histograms(worker: RunningWorker) -> None:
    httpx.post(f"{worker.url}/v2/models/doubler/infer", json=infer_body([1.0]))
    text = httpx.get(f"{worker.url}/metrics").text
    assert 'tailserve_request_duration_seconds_bucket{le="0.005",model="doubler"' in text
    assert 'tailserve_batch_size_rows_count{bucket="all",model="doubler"}' in text
    assert 'tailserve_batch_duration_seconds_count{bucket="all",model="doubler"}' in text
    assert 'tailserve_batch_predicted_seconds_count{bucket="all",model="doubler"}' in text
    assert 'tailserve_cost_model_fixed_seconds{bucket="all",model="doubler",version="1"}' in text
    assert 'tailserve_queue_duration_seconds_count{model="doubler"}' in text
    assert 'tailserve_compute_duration_seconds_count{bucket="all",model="doubler"}' in text
    assert 'tailserve_requests_total{model="doubler",protocol="v2",status="200"}' in text
    assert 'tailserve_model_ready{model="broken"} 0.0' in text


def test_admin_routes_need_the_token(worker: RunningWorker) -> None:
    url = f"{worker.url}/v2/repository/index"
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    reply = httpx.post(url, headers={"Authorization": "Bearer s3cret"})
    assert reply.status_code == 200
    index = {(e["name"], e.get("version")): e for e in reply.json()}
    assert index[("doubler", "1")]["state"] == "READY"
    assert index[("broken", None)]["state"] == "UNAVAILABLE"
    assert "refuses to load" in index[("broken", None)]["reason"]


def test_unload_then_load_again(tmp_path: Path) -> None:
    write_model(tmp_path, "doubler", doubler_config())
    with run_worker(Settings(repository=str(tmp_path))) as running:
        admin = f"{running.url}/v2/repository/models/doubler"
        assert httpx.post(f"{admin}/unload").status_code == 200
        reply = httpx.post(f"{running.url}/v2/models/doubler/infer", json=infer_body([1.0]))
        assert reply.status_code == 503
        assert httpx.get(f"{running.url}/v2/models/doubler/ready").status_code == 400
        assert httpx.post(f"{admin}/load").status_code == 200
        assert_still_serving(running.url)
        missing = httpx.post(f"{running.url}/v2/repository/models/ghost/load")
        assert missing.status_code == 404


def test_sampled_trace_log_records_infer_requests(tmp_path: Path) -> None:
    from tailserve.observability.trace_log import read_trace

    write_model(tmp_path / "repo", "doubler", doubler_config())
    trace = tmp_path / "trace.jsonl"
    settings = Settings(repository=str(tmp_path / "repo"), trace_file=str(trace))
    with run_worker(settings) as running:
        for value in (1.0, 2.0, 3.0):
            httpx.post(f"{running.url}/v2/models/doubler/infer", json=infer_body([value]))
        httpx.get(f"{running.url}/v2/health/ready")  # not an inference request: not logged
    entries = read_trace(trace)
    assert [e["path"] for e in entries] == ["/v2/models/doubler/infer"] * 3
    assert [orjson.loads(e["body"])["inputs"][0]["data"] for e in entries] == [[1.0], [2.0], [3.0]]
    assert entries[0]["t"] <= entries[1]["t"] <= entries[2]["t"]
    assert entries[0]["headers"]["content-type"] == "application/json"


def test_large_or_compressed_bodies_are_decoded_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_model(tmp_path, "doubler", doubler_config())
    with run_worker(Settings(repository=str(tmp_path))) as worker:
        _decode_off_the_loop(worker, monkeypatch)


def _decode_off_the_loop(worker: RunningWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    decode, typed = oip.decode_request, oip_typed.TypedDecoder.decode

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return decode(*args)

    def typed_spy(*args: Any) -> Any:  # (the model's own decoder reads it first)
        threads.append(threading.current_thread().name)
        return typed(*args)

    monkeypatch.setattr(oip, "decode_request", spy)
    monkeypatch.setattr(oip_typed.TypedDecoder, "decode", typed_spy)
    url = f"{worker.url}/v2/models/doubler/infer"
    small = orjson.dumps(infer_body([1.0]))
    large = small[:-1] + b" " * 300_000 + b"}"  # the same request, padded past 256 KiB
    outputs = []
    for content, encoding in ((small, None), (large, None), (gzip.compress(small), "gzip")):
        headers = {"content-type": "application/json"}
        if encoding:
            headers["content-encoding"] = encoding
        reply = httpx.post(url, content=content, headers=headers)
        assert reply.status_code == 200, reply.text
        outputs.append(reply.json()["outputs"])
    assert outputs[0] == outputs[1] == outputs[2]
    loop, *off = threads
    assert len(off) == 2 and loop not in off, threads
    # An error found on the thread is the client's 400 as ever.
    reply = httpx.post(url, content=large[:-1] + b"]", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]
    assert_still_serving(worker.url)


def test_a_405_says_which_methods_the_path_takes(worker: RunningWorker) -> None:
    # Found by tests/fuzz (schemathesis): a 405 without Allow (RFC 9110 requires it).
    reply = httpx.put(f"{worker.url}/v2/health/live")
    assert (reply.status_code, reply.headers["allow"]) == (405, "GET")
    reply = httpx.put(f"{worker.url}/v1/models/doubler:predict")  # not the v1 status route's
    assert (reply.status_code, reply.headers["allow"]) == (405, "POST")
    reply = httpx.delete(f"{worker.url}/v2/jobs/abc")
    assert reply.status_code != 405
    assert httpx.put(f"{worker.url}/v2/jobs/abc").headers["allow"] == "DELETE, GET"


def test_openapi_declares_every_path_parameter(worker: RunningWorker) -> None:
    # Found by tests/fuzz: /v2/jobs/{job} did not declare 'job'.
    document = httpx.get(f"{worker.url}/openapi.json").json()
    for template, operations in document["paths"].items():
        for operation in operations.values():
            declared = {p["name"] for p in operation["parameters"] if p["in"] == "path"}
            assert declared == set(re.findall(r"\{(\w+)\}", template)), template


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v2/repository/index", {"ready": {}}, "'ready' must be true or false"),
        ("/v2/repository/index", False, "body must be an object"),
        ("/v2/cache/invalidate", {"model": "m", "prefix": None}, "field 'prefix'"),
        ("/v2/cache/invalidate", {"model": "m", "version": -1}, "field 'version'"),
    ],
)
def test_admin_bodies_of_the_wrong_type_are_refused(
    worker: RunningWorker, path: str, body: object, named: str
) -> None:
    # Found by tests/fuzz: these were taken (null as absent, {} as false).
    reply = httpx.post(f"{worker.url}{path}", json=body, headers={"Authorization": "Bearer s3cret"})
    assert reply.status_code == 400
    assert named in reply.json()["error"]
