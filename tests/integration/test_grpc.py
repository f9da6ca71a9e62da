"""The Open Inference Protocol over gRPC, spoken by an unchanged `tritonclient.grpc`."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2

from support.churn import FIELDS, columns
from support.servers import RunningWorker, free_port, run_worker
from tailserve.protocols.grpc import schema
from tailserve.settings import Settings

OUTPUT = "churn_probability"


@pytest.fixture(scope="module")
def worker(example_repository: Path) -> Iterator[tuple[RunningWorker, str]]:
    port = free_port()
    settings = Settings(repository=str(example_repository), grpc_port=port)
    with run_worker(settings) as running:
        yield running, f"127.0.0.1:{port}"


def grpc_inputs(data: dict[str, np.ndarray[Any, Any]]) -> list[Any]:
    inputs = []
    for name, array in data.items():
        tensor = triton_grpc.InferInput(name, list(array.shape), FIELDS[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def test_the_messages_are_the_protocols_field_for_field() -> None:
    # Names, numbers, types and map entries as in the client's own copy of the .proto.
    def fields(descriptor: Any) -> dict[str, Any]:
        found = {}
        for f in descriptor.fields:
            kind = f.message_type.full_name if f.message_type else None
            repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == 3
            found[f.name] = (f.number, f.type, repeated, kind)
        for nested in descriptor.nested_types:
            found[nested.name] = (fields(nested), nested.GetOptions().map_entry)
        return found

    names = [
        "ServerLiveResponse",
        "ServerReadyResponse",
        "ModelReadyRequest",
        "ModelReadyResponse",
        "ServerMetadataResponse",
        "ModelMetadataRequest",
        "ModelMetadataResponse",
        "ModelInferRequest",
        "ModelInferResponse",
        "InferParameter",
        "InferTensorContents",
    ]
    for name in names:
        theirs = service_pb2.DESCRIPTOR.message_types_by_name[name]
        assert fields(schema.message(name).DESCRIPTOR) == fields(theirs), name


def test_health_and_metadata(worker: tuple[RunningWorker, str]) -> None:
    _, address = worker
    client = triton_grpc.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("churn")
    assert not client.is_model_ready("churn", "99")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "tailserve" and "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("churn", as_json=True)
    assert {i["name"] for i in model["inputs"]} == set(FIELDS)
    assert all(i["shape"] == ["-1", "1"] for i in model["inputs"])  # int64s in proto JSON
    client.close()


@pytest.mark.parametrize("model", ["churn", "churn_lgbm"])
def test_grpc_answers_as_http_does(worker: tuple[RunningWorker, str], model: str) -> None:
    running, address = worker
    data = columns(6, seed=5)
    client = triton_grpc.InferenceServerClient(address)
    result = client.infer(
        model,
        grpc_inputs(data),
        outputs=[triton_grpc.InferRequestedOutput(OUTPUT)],
        request_id="r-1",
    )
    over_grpc = result.as_numpy(OUTPUT)
    response = result.get_response(as_json=True)
    client.close()
    http = triton_http.InferenceServerClient(f"127.0.0.1:{running.port}")
    inputs = []
    for name, array in data.items():
        tensor = triton_http.InferInput(name, list(array.shape), FIELDS[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    over_http = http.infer(model, inputs).as_numpy(OUTPUT)
    http.close()
    assert over_grpc.shape == (6, 1) and over_grpc.dtype == np.float32
    np.testing.assert_array_equal(over_grpc, over_http)
    assert response["id"] == "r-1" and response["model_name"] == model
    # How it was served travels as parameters, as over HTTP.
    assert int(response["parameters"]["batch_size"]["int64_param"]) >= 1


def model_infer(address: str, request: Any) -> Any:
    """A ModelInfer call as a bare gRPC client makes it (no client library's checks)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{schema.SERVICE}/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=schema.ModelInferResponse.FromString,
        )
        return call(request, timeout=30)


def test_typed_contents_are_read_as_raw_ones_are(worker: tuple[RunningWorker, str]) -> None:
    # A client that sends typed contents instead of raw buffers (the KServe way).
    _, address = worker
    data = columns(2, seed=7)
    request = schema.ModelInferRequest(model_name="churn")
    for name, array in data.items():
        tensor = request.inputs.add(name=name, datatype=FIELDS[name], shape=list(array.shape))
        values = array.reshape(-1).tolist()
        if FIELDS[name] == "BYTES":
            tensor.contents.bytes_contents.extend(values)
        elif FIELDS[name] == "FP32":
            tensor.contents.fp32_contents.extend(values)
        else:
            tensor.contents.int64_contents.extend(values)
    reply = model_infer(address, request)
    typed = np.frombuffer(reply.raw_output_contents[0], dtype=np.float32).reshape(2, 1)
    client = triton_grpc.InferenceServerClient(address)
    raw = client.infer("churn", grpc_inputs(data)).as_numpy(OUTPUT)
    client.close()
    np.testing.assert_array_equal(typed, raw)


def test_errors_are_grpc_statuses_naming_the_problem(worker: tuple[RunningWorker, str]) -> None:
    running, address = worker
    client = triton_grpc.InferenceServerClient(address)
    data = columns(2)
    data["tenure_months"][1, 0] = 500  # out of the model's declared range
    with pytest.raises(triton_grpc.InferenceServerException) as bad:
        client.infer("churn", grpc_inputs(data))
    assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "tenure_months" in bad.value.message()
    with pytest.raises(triton_grpc.InferenceServerException) as unknown:
        client.infer("no_such_model", grpc_inputs(columns(1)))
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    # Raw data shorter than its shape, and buffers that do not match the inputs: the client
    # library would not send these, a bare gRPC client may.
    short = schema.ModelInferRequest(model_name="churn")
    short.inputs.add(name="tenure_months", datatype="INT64", shape=[3, 1])
    short.raw_input_contents.append(np.zeros(2, dtype=np.int64).tobytes())
    with pytest.raises(grpc.RpcError) as failed:
        model_infer(address, short)
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 24 bytes" in failed.value.details()
    short.raw_input_contents.append(b"")
    with pytest.raises(grpc.RpcError) as failed:
        model_infer(address, short)
    assert "2 buffers for 1 inputs" in failed.value.details()
    # Bytes that are no ModelInferRequest at all.
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary(f"/{schema.SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as garbage:
            raw(b"\xff\xff\xff\xff", timeout=30)
    assert garbage.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ModelInferRequest" in garbage.value.details()
    # Still serving, over both protocols; the refusals were counted under grpc.
    assert client.infer("churn", grpc_inputs(columns(1))).as_numpy(OUTPUT).shape == (1, 1)
    client.close()
    metrics = httpx.get(f"{running.url}/metrics").text
    assert 'protocol="grpc"' in metrics and 'status="400"' in metrics


def test_calls_of_a_layout_met_before_answer_as_the_first_did(
    worker: tuple[RunningWorker, str],
) -> None:
    # The first call of three rows is read the general way and its layout kept; the next
    # ones are read in one pass (grpc/layouts.py): the same answers as over HTTP, the same
    # refusal for a value out of range.
    running, address = worker
    client = triton_grpc.InferenceServerClient(address)
    http = triton_http.InferenceServerClient(f"127.0.0.1:{running.port}")
    try:
        for seed in (11, 12, 13):
            data = columns(3, seed=seed)
            over_grpc = client.infer("churn", grpc_inputs(data)).as_numpy(OUTPUT)
            inputs = []
            for name, array in data.items():
                tensor = triton_http.InferInput(name, list(array.shape), FIELDS[name])
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            np.testing.assert_array_equal(over_grpc, http.infer("churn", inputs).as_numpy(OUTPUT))
        data = columns(3, seed=14)
        data["tenure_months"][2, 0] = 121
        data["contract_type"][0, 0] = b"weekly"
        with pytest.raises(triton_grpc.InferenceServerException) as bad:
            client.infer("churn", grpc_inputs(data))
        assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "'tenure_months': value 121 is outside the allowed range [1, 120]" in (
            bad.value.message()
        )
    finally:
        client.close()
        http.close()


def test_a_taken_grpc_port_leaves_http_serving(
    example_repository: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # churn alone: two workers each loading the whole repository (sentiment's warm-up) is 20 s
    shutil.copytree(example_repository / "churn", tmp_path / "churn")
    with run_worker(Settings(repository=str(tmp_path), grpc_port=free_port())) as a:
        taken = a.worker.settings.grpc_port
        with (
            caplog.at_level(logging.ERROR),
            run_worker(Settings(repository=str(tmp_path), grpc_port=taken)) as b,
        ):
            assert httpx.get(f"{b.url}/v2/health/ready").status_code == 200
        assert f"worker: no gRPC on 127.0.0.1:{taken}" in caplog.text  # b said why
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{taken}")
        assert client.is_server_live()  # and a serves gRPC as before
        client.close()


def test_grpc_calls_count_in_the_loops_backlog_as_http_requests_do(
    worker: tuple[RunningWorker, str],
) -> None:
    # Admission reads the event loop's backlog from these counts: a gRPC call must weigh on it
    # as an HTTP request does.
    running, address = worker
    counts = running.worker.loop_lag.requests
    assert counts is not None
    _, answered_before, _ = counts()
    with triton_grpc.InferenceServerClient(address) as client:
        for seed in range(5):
            client.infer("churn", grpc_inputs(columns(2, seed=seed)))
    in_flight, answered, _ = counts()
    assert answered - answered_before == 5
    assert in_flight == 0
