"""The gRPC adapter's translations, without a server: messages to the engine's requests and
back, and a call's deadline into the request."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from tailserve.engine.kept_refusals import KeptRefusals
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import DeadlineUnmeetable, InvalidInput
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.common import _guarded
from tailserve.protocols.grpc.service import InferenceService, decode_request, encode_response
from tailserve.tensors import Tensor


def request_with_parameters() -> Any:
    message = schema.ModelInferRequest(model_name="m", model_version="2", id="a")
    message.parameters["timeout"].int64_param = 250_000
    message.parameters["cache"].string_param = "bypass"
    message.parameters["binary_data_output"].bool_param = True
    message.parameters["weight"].double_param = 0.5
    tensor = message.inputs.add(name="x", datatype="FP32", shape=[2, 1])
    tensor.parameters["note"].string_param = "raw"
    message.raw_input_contents.append(np.array([1.5, 2.5], dtype=np.float32).tobytes())
    message.outputs.add(name="y")
    return message


def test_a_request_becomes_the_engines_with_its_parameters() -> None:
    request = decode_request(request_with_parameters())
    assert (request.model, request.version, request.id) == ("m", "2", "a")
    assert request.parameters == {
        "timeout": 250_000,
        "cache": "bypass",
        "binary_data_output": True,
        "weight": 0.5,
    }
    (tensor,) = request.inputs
    assert tensor.name == "x" and tensor.parameters == {"note": "raw"}
    assert tensor.data.tolist() == [[1.5], [2.5]]
    assert request.outputs is not None and [o.name for o in request.outputs] == ["y"]


def test_a_version_or_id_left_empty_is_none() -> None:
    message = schema.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="INT64", shape=[1]).contents.int64_contents.append(7)
    request = decode_request(message)
    assert request.version is None and request.id is None and request.outputs is None
    assert request.inputs[0].data.tolist() == [7]


@pytest.mark.parametrize(
    ("datatype", "message"),
    [("FP16", "FP16 travels in raw_input_contents only"), ("FP32", "needs 1 elements")],
)
def test_typed_contents_that_cannot_be_read_are_refused(datatype: str, message: str) -> None:
    request = schema.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype=datatype, shape=[1])
    with pytest.raises(InvalidInput, match=message):
        decode_request(request)


def test_a_response_goes_back_raw_with_its_parameters() -> None:
    outputs = [
        Tensor("y", "FP32", np.array([[0.25], [0.75]], dtype=np.float32)),
        Tensor("label", "BYTES", np.array([b"a", b"bc"], dtype=object)),
    ]
    response = InferResponse(
        model="m",
        version="2",
        outputs=outputs,
        id="a",
        parameters={
            "batch_size": 4,
            "cache": "l1",
            "hedged": False,
            "queue_us": 12.5,
            "lineage": {"computed_by": "w1"},
        },
    )
    message = schema.ModelInferResponse.FromString(encode_response(response).SerializeToString())
    assert [o.name for o in message.outputs] == ["y", "label"]
    assert list(message.outputs[0].shape) == [2, 1] and message.outputs[1].datatype == "BYTES"
    y = np.frombuffer(message.raw_output_contents[0], dtype=np.float32)
    assert y.tolist() == [0.25, 0.75]
    assert message.raw_output_contents[1] == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"
    p = message.parameters
    assert p["batch_size"].int64_param == 4 and p["cache"].string_param == "l1"
    assert p["hedged"].WhichOneof("parameter_choice") == "bool_param"
    assert p["queue_us"].double_param == 12.5
    assert p["lineage"].string_param == '{"computed_by":"w1"}'


class Plane:
    """A data plane that records what it is asked to shed and infer."""

    def __init__(self) -> None:
        self.seen: list[InferRequest] = []
        self.sheds: list[float | None] = []
        self.screened: list[bool] = []
        self.refusals = KeptRefusals(self.shed, lambda name, version: None)

    def knows(self, model: str) -> bool:
        return True

    def serving(self, model: str, version: str | None = None) -> None:
        return None  # (no model version a layout reader could read)

    def shed(
        self, name: str, version: str | None, *, received_at: float, deadline_ms: float | None
    ) -> None:
        self.sheds.append(deadline_ms)

    async def infer(self, request: InferRequest, *, screened: bool = False) -> InferResponse:
        self.seen.append(request)
        self.screened.append(screened)
        return InferResponse(model=request.model, version="1", outputs=[], parameters={})


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(("remaining", "deadline_ms"), [(0.25, 250.0), (None, None)])
async def test_the_calls_deadline_is_the_requests(
    remaining: float | None, deadline_ms: float | None
) -> None:
    plane = Plane()
    service = InferenceService(plane)  # type: ignore[arg-type]
    await service.model_infer(request_with_parameters(), Context(remaining))  # type: ignore[arg-type]
    (seen,) = plane.seen
    assert seen.deadline_ms == deadline_ms and seen.received_at is not None


@pytest.mark.parametrize(
    ("remaining", "has_timeout", "sheds"),
    [(0.25, True, [250.0]), (None, False, [None]), (None, True, [])],
)
async def test_a_call_is_shed_before_it_is_decoded(
    remaining: float | None, has_timeout: bool, sheds: list[float | None]
) -> None:
    # As over HTTP: for the call's deadline, else the SLO; but a `timeout` parameter with no
    # gRPC deadline may be looser than the SLO, and is left to admission.
    message = request_with_parameters()
    if not has_timeout:
        del message.parameters["timeout"]
    plane = Plane()
    service = InferenceService(plane)  # type: ignore[arg-type]
    await service.model_infer(message, Context(remaining))  # type: ignore[arg-type]
    assert plane.sheds == sheds and plane.screened == [bool(sheds)]


async def test_a_refusal_of_a_moment_ago_answers_the_like_calls_after_it() -> None:
    # As over HTTP: the data plane keeps a refusal of an overloaded model for the calls of the
    # same kind that come with less time left; the model is not asked again.
    plane = Plane()
    refusal = DeadlineUnmeetable(
        "too busy", deadline=time.monotonic() + 0.25, least_budget_s=0.3, reusable_until=1e12
    )

    def shed(name: str, version: str | None, **_: float | None) -> None:
        plane.sheds.append(None)
        raise refusal

    plane.refusals = KeptRefusals(shed, lambda name, version: None)
    service = InferenceService(plane)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(DeadlineUnmeetable, match="too busy"):
            await service.model_infer(request_with_parameters(), Context(0.25))  # type: ignore[arg-type]
    assert len(plane.sheds) == 1 and plane.seen == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_parameter_that_is_no_finite_number_is_refused(value: float) -> None:
    # Sent on as JSON (the router's gateway) it would become null and vanish unseen.
    message = request_with_parameters()
    message.parameters["timeout"].double_param = value
    with pytest.raises(InvalidInput, match=r"parameter 'timeout' is .*: not a finite number"):
        decode_request(message)


class _EndedCall:
    """A call whose deadline passed while its handler ran: it can no longer be answered."""

    def __init__(self) -> None:
        self.aborts = 0

    def done(self) -> bool:
        return True

    async def abort(self, code: Any, details: str, *metadata: Any) -> None:
        self.aborts += 1
        raise RuntimeError("the call is over")


async def test_a_handler_that_fails_on_a_call_already_over_is_let_go_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: Any, context: Any) -> Any:
        await context.abort(None, "late")  # fails: the call is over

    call = _EndedCall()
    assert await _guarded(handler)(object(), call) is None  # type: ignore[arg-type]
    assert call.aborts == 1  # its own, not a second one for an "internal error"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
