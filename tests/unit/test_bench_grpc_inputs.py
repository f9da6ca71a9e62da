"""What `tailserve bench` sends over gRPC, before any socket: requests the worker's own decoder
and checks accept, options as parameters, a stream's ids, targets, and the workloads refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tailserve.engine.validation import InputPlan
from tailserve.errors import ConfigError
from tailserve.examples.churn import model_config
from tailserve.loadgen.bench import Target, link_for, load_model_config
from tailserve.loadgen.grpc_sender import served_of, status_of, with_id
from tailserve.loadgen.inputs import fields_for, prepare
from tailserve.loadgen.plan import build_plan
from tailserve.loadgen.sending import CACHE_TIERS, ERROR_KINDS, GRPC_BASE, OK
from tailserve.loadgen.workload import parse_workload
from tailserve.modelconfig import parse_model_config
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.common import parameters_of, set_parameter
from tailserve.protocols.grpc.service import decode_request

CONFIG = {"name": "churn", **model_config("onnx")}
PLAN = InputPlan(parse_model_config(CONFIG, source="churn"))


def workload(**fields: Any) -> Any:
    raw = {"model": "churn", "protocol": "grpc", "target": "127.0.0.1:8001", **fields}
    return parse_workload(raw, source="test")


@pytest.mark.parametrize("protocol", ["grpc", "grpc-stream"])
def test_every_request_is_a_model_infer_request_the_worker_accepts(protocol: str) -> None:
    w = workload(protocol=protocol, classes=[{"rows": 1}, {"name": "bulk", "rows": 8}])
    for prepared in prepare(w, fields_for(CONFIG, w.fields), 40):
        message = schema.ModelInferRequest.FromString(prepared.body)
        # Raw buffers, as the binary HTTP extension carries them: one an input.
        assert len(message.raw_input_contents) == len(message.inputs) == 9
        assert message.id == ""  # (a stream's sender gives each its own)
        request = decode_request(message)
        assert request.model == "churn" and request.version is None
        assert PLAN.check(request.inputs).rows == w.classes[prepared.cls].rows


def test_options_travel_as_parameters_and_deadlines_as_grpc_has_them() -> None:
    options = {"deadline_ms": 80, "priority": 2, "cache": "bypass", "headers": {"X-Tenant": "a"}}
    unary = workload(options=options)
    body = prepare(unary, fields_for(CONFIG, {}), 1)[0].body
    assert parameters_of(schema.ModelInferRequest.FromString(body).parameters) == {
        "priority": 2,
        "cache": "bypass",
    }
    link = link_for(unary, Target.of(unary))
    # A unary call's deadline is the call's gRPC deadline (read by the worker as X-Deadline-Ms).
    assert link.deadline_s == pytest.approx(0.08)
    assert link.metadata == (("x-tenant", "a"),)
    assert (link.protocol, link.host, link.port) == ("grpc", "127.0.0.1", 8001)
    stream = workload(protocol="grpc-stream", options=options, grpc={"streams": 3, "channels": 2})
    body = prepare(stream, fields_for(CONFIG, {}), 1)[0].body
    # A stream's requests have no deadline of their own: the `timeout` parameter (µs).
    parameters = parameters_of(schema.ModelInferRequest.FromString(body).parameters)
    assert parameters["timeout"] == 80_000
    link = link_for(stream, Target.of(stream))
    assert (link.protocol, link.streams, link.connections, link.deadline_s) == (
        "grpc-stream",
        3,
        2,
        None,
    )


def test_a_plan_over_grpc_holds_the_messages_themselves() -> None:
    w = workload(schedule={"kind": "constant", "rate": 50}, duration_s=1.0, warmup_s=0.0)
    plan = build_plan(w, CONFIG, "127.0.0.1:8001")
    assert len(plan) == 50
    assert all(
        schema.ModelInferRequest.FromString(data).model_name == "churn" for data in plan.requests
    )


def test_an_appended_id_names_the_request() -> None:
    body = prepare(workload(), fields_for(CONFIG, {}), 1)[0].body
    for index in (0, 7, 123_456_789):
        message = schema.ModelInferRequest.FromString(with_id(body, index))
        assert message.id == str(index)
        assert (
            message.raw_input_contents
            == schema.ModelInferRequest.FromString(body).raw_input_contents
        )


def test_statuses_and_the_servers_account_read_from_a_reply() -> None:
    import grpc

    assert status_of(grpc.StatusCode.OK) == OK
    unavailable = status_of(grpc.StatusCode.UNAVAILABLE)
    assert unavailable == GRPC_BASE + 14 and ERROR_KINDS[unavailable] == "grpc_unavailable"
    reply = schema.ModelInferResponse(model_name="churn")
    assert served_of(reply) is None
    for key, value in {"queue_us": 120, "compute_us": 900, "batch_size": 4, "cache": "l2"}.items():
        set_parameter(reply.parameters[key], value)
    served = served_of(reply)
    assert served is not None
    assert (served.queue_us, served.compute_us, served.batch_size) == (120, 900, 4)
    assert CACHE_TIERS[served.cache] == "l2"


def test_a_choice_of_numbers_draws_integers() -> None:
    w = workload(fields={"tenure_months": {"choice": [5, 99], "weights": [1, 1]}})
    fields = fields_for(CONFIG, w.fields)
    tenure = fields[[f.name for f in fields].index("tenure_months")]
    values = tenure.draw(np.random.default_rng(0), 200)
    assert values.dtype == np.int64 and set(values.tolist()) == {5, 99}


def test_targets_and_workloads_refused_over_grpc(tmp_path: Path) -> None:
    assert Target.parse("10.0.0.2:8001", grpc=True).url == "grpc://10.0.0.2:8001"
    assert Target.parse("grpc://host:9", grpc=True) == Target("host", 9, True)
    with pytest.raises(ConfigError, match="over gRPC, a target is host:port"):
        Target.parse("http://127.0.0.1:8000", grpc=True)
    with pytest.raises(ConfigError, match="names no host and port"):
        Target.parse("127.0.0.1", grpc=True)
    with pytest.raises(ConfigError, match="over HTTP, a target is an http:// URL"):
        Target.parse("grpc://127.0.0.1:8001")
    with pytest.raises(ConfigError, match=r"field 'protocol'.*not over gRPC"):
        workload(schedule={"kind": "trace", "trace": "t.jsonl"})
    with pytest.raises(ConfigError, match="field 'grpc'"):
        workload(grpc={"streams": 0})
    with pytest.raises(ConfigError, match="model_config"):
        load_model_config(workload())
