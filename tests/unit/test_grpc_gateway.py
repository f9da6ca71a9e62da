"""The router's gRPC front as pure translation: a ModelInferRequest into the worker's binary
HTTP request, and the worker's reply back into a ModelInferResponse."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from tailserve.errors import InvalidInput
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.common import parameters_of
from tailserve.protocols.http.oip import decode_request
from tailserve.router.grpc_gateway import http_request, infer_response
from tailserve.router.keys import body_key
from tailserve.router.messages import Outcome
from tailserve.tensors import to_binary

WORDS = [b"ab", "\u00e9t\u00e9".encode()]


def _request() -> object:
    message = schema.ModelInferRequest(model_name="m", id="r7")
    message.inputs.add(name="x", datatype="FP32", shape=[2, 1])
    text = message.inputs.add(name="text", datatype="BYTES", shape=[2])
    text.parameters["note"].string_param = "kept"
    message.raw_input_contents.append(np.array([[1.5], [-2.0]], np.float32).tobytes())
    message.raw_input_contents.append(to_binary(np.array(WORDS, object)))
    message.parameters["priority"].int64_param = 2
    message.parameters["timeout"].int64_param = 30_000
    message.parameters["cache"].string_param = "bypass"
    return message


def test_a_request_becomes_the_binary_extension_the_worker_decodes() -> None:
    body, length = http_request(_request())
    decoded = decode_request("m", None, body, length)
    assert decoded.id == "r7"
    assert [t.name for t in decoded.inputs] == ["x", "text"]
    assert decoded.inputs[0].data.tolist() == [[1.5], [-2.0]]
    assert [bytes(v) for v in decoded.inputs[1].data.tolist()] == WORDS
    assert decoded.inputs[1].parameters["note"] == "kept"
    # The request's options go as they came; every output is asked back raw.
    assert decoded.parameters == {
        "priority": 2,
        "timeout": 30_000,
        "cache": "bypass",
        "binary_data_output": True,
    }
    assert decoded.outputs is None


def test_named_outputs_are_asked_back_raw_with_their_parameters() -> None:
    message = _request()
    wanted = message.outputs.add(name="y")  # type: ignore[attr-defined]
    wanted.parameters["classification"].int64_param = 2
    body, length = http_request(message)
    header = orjson.loads(body[:length])
    assert header["outputs"] == [
        {"name": "y", "parameters": {"classification": 2, "binary_data": True}}
    ]


def test_typed_contents_become_raw_data() -> None:
    message = schema.ModelInferRequest(model_name="m")
    x = message.inputs.add(name="x", datatype="INT64", shape=[1, 3])
    x.contents.int64_contents.extend([1, -2, 3])
    s = message.inputs.add(name="s", datatype="BYTES", shape=[1])
    s.contents.bytes_contents.append(b"hi")
    decoded = decode_request("m", None, *http_request(message))
    assert decoded.inputs[0].data.tolist() == [[1, -2, 3]]
    assert decoded.inputs[0].data.dtype == np.int64
    assert [bytes(v) for v in decoded.inputs[1].data.tolist()] == [b"hi"]


def test_requests_the_router_refuses_itself() -> None:
    counted = schema.ModelInferRequest(model_name="m")
    counted.inputs.add(name="x", datatype="FP32", shape=[1])
    counted.raw_input_contents.extend([b"\0" * 4, b"\0" * 4])
    with pytest.raises(InvalidInput, match="2 buffers for 1 inputs"):
        http_request(counted)
    untyped = schema.ModelInferRequest(model_name="m")
    untyped.inputs.add(name="h", datatype="FP16", shape=[1])
    with pytest.raises(InvalidInput, match="FP16 travels in raw_input_contents only"):
        http_request(untyped)
    short = schema.ModelInferRequest(model_name="m")
    tensor = short.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    with pytest.raises(InvalidInput, match="x"):
        http_request(short)


def test_the_affinity_key_is_the_inputs_not_the_id_or_options() -> None:
    first = _request()
    second = _request()
    second.id = "another"  # type: ignore[attr-defined]
    second.parameters["cache"].string_param = "refresh"  # type: ignore[attr-defined]
    assert body_key(*http_request(first)) == body_key(*http_request(second))
    other = _request()
    other.raw_input_contents[0] = np.array([[1.5], [2.0]], np.float32).tobytes()  # type: ignore[attr-defined]
    assert body_key(*http_request(other)) != body_key(*http_request(first))
    keyed = _request()
    keyed.parameters["affinity_key"].string_param = "user-9"  # type: ignore[attr-defined]
    assert body_key(*http_request(keyed)) == "user-9"


def _reply(document: dict[str, object], *chunks: bytes) -> Outcome:
    header = orjson.dumps(document)
    if not chunks:
        return Outcome(200, [(b"content-type", b"application/json")], header)
    headers = [(b"Inference-Header-Content-Length", str(len(header)).encode())]
    return Outcome(200, headers, header + b"".join(chunks))


def test_a_binary_reply_becomes_raw_outputs_with_its_parameters() -> None:
    y = np.array([[0.25], [0.75]], np.float32).tobytes()
    labels = to_binary(np.array([b"no", b"yes"], object))
    outcome = _reply(
        {
            "model_name": "m",
            "model_version": "3",
            "id": "r7",
            "outputs": [
                {
                    "name": "y",
                    "datatype": "FP32",
                    "shape": [2, 1],
                    "parameters": {"binary_data_size": len(y)},
                },
                {
                    "name": "label",
                    "datatype": "BYTES",
                    "shape": [2],
                    "parameters": {"binary_data_size": len(labels), "classes": 2},
                },
            ],
            "parameters": {"cache": "l1", "batch_size": 4, "lineage": {"computed_by": "w1"}},
        },
        y,
        labels,
    )
    message = infer_response(outcome)
    assert (message.model_name, message.model_version, message.id) == ("m", "3", "r7")
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [
        ("y", "FP32", [2, 1]),
        ("label", "BYTES", [2]),
    ]
    assert list(message.raw_output_contents) == [y, labels]
    assert parameters_of(message.outputs[1].parameters) == {"classes": 2}
    parameters = parameters_of(message.parameters)
    assert parameters["cache"] == "l1" and parameters["batch_size"] == 4
    assert orjson.loads(parameters["lineage"]) == {"computed_by": "w1"}


def test_a_json_reply_is_sent_on_raw() -> None:
    outcome = _reply(
        {
            "model_name": "m",
            "model_version": 1,
            "outputs": [{"name": "y", "datatype": "INT32", "shape": [1, 2], "data": [4, -5]}],
        }
    )
    message = infer_response(outcome)
    assert message.model_version == "1"
    assert np.frombuffer(message.raw_output_contents[0], np.int32).tolist() == [4, -5]
