"""The gRPC layout reader against the general way: the same request, or none at all.

Once a request has been read and checked the general way, a request of the same layout (the
same inputs, only the raw buffers differing) is either read by the layout reader exactly as the
general decoder and the model's input plan would read it (the same tensors, checked arrays, rows
and batching group) or left to the general way, which says what is wrong.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.layouts import CONFIG, EDGES, GOOD, INPUTS, SPECS, UNBATCHED, VALID, raw, same
from tailserve.engine.validation import Checked, InputPlan
from tailserve.errors import InvalidInput
from tailserve.modelconfig import parse_model_config
from tailserve.protocols.grpc import schema
from tailserve.protocols.grpc.layouts import KEPT, SEEN, LayoutReader, reader_for
from tailserve.protocols.grpc.service import decode_request
from tailserve.tensors import Tensor


def _message(
    values: dict[str, list[Any]],
    shapes: dict[str, list[int]] | None = None,
    raws: dict[str, bytes] | None = None,
) -> Any:
    shapes, raws = shapes or {}, raws or {}
    message = schema.ModelInferRequest(model_name="m", id="r1")
    for name, data in values.items():
        spec = SPECS[name]
        width = 3 if name == "vec" else len(data)
        shape = shapes.get(name, [max(1, len(data) // width), width])
        message.inputs.add(name=name, datatype=spec["datatype"], shape=shape)
        message.raw_input_contents.append(raws.get(name, raw(spec["datatype"], data)))
    return message


def _learnt(reader: LayoutReader, message: Any) -> None:
    """``message`` read the general way twice (a layout is kept the second time)."""
    for _ in range(2):
        assert reader.learn(message, decode_request(message).inputs) is not None


def _reader() -> LayoutReader:
    reader = LayoutReader(CONFIG, InputPlan(CONFIG))
    _learnt(reader, _message(GOOD))
    return reader


def _general(reader: LayoutReader, message: Any) -> tuple[list[Tensor], Checked] | str:
    try:
        inputs = decode_request(message).inputs
        return inputs, reader.plan.check(inputs)
    except InvalidInput as exc:
        return exc.message


def test_a_layout_met_once_is_read_in_one_pass_as_the_general_way_reads_it() -> None:
    reader = _reader()
    other = dict(GOOD, age=[120], spend=[0.0], plan=[b"a"], text=[b""], tokens=[0, 999, 3, 4])
    message = _message(other)
    found = reader.read(message)
    assert found is not None
    general = _general(reader, message)
    assert not isinstance(general, str)
    same(found, general)
    assert found[0][0].data.tolist() == [[120]]


def test_a_layout_not_met_goes_the_general_way() -> None:
    reader = LayoutReader(CONFIG, InputPlan(CONFIG))
    assert reader.read(_message(GOOD)) is None
    longer = _message(dict(GOOD, tokens=[1, 2, 3, 4, 5]))
    learnt = _reader()
    assert learnt.read(longer) is None  # (another shape: another layout)
    assert learnt.read(_message({k: v for k, v in GOOD.items() if k != "flag"})) is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"age": [121]}, "outside the allowed range"),
        ({"age": [0]}, "outside the allowed range"),
        ({"small": [201]}, "outside the allowed range"),
        ({"spend": [0.10000001]}, "outside the allowed range"),
        ({"exact": [math.nan]}, "outside the allowed range"),
        ({"exact": [-1.5000000000000002]}, "outside the allowed range"),
        ({"plan": [b"c"]}, "unknown value"),
        ({"tokens": [5, 6, 7, 1000]}, "outside the allowed range"),
    ],
)
def test_a_value_the_model_refuses_goes_the_general_way(
    change: dict[str, list[Any]], error: str
) -> None:
    reader = _reader()
    message = _message(dict(GOOD, **change))
    assert reader.read(message) is None
    general = _general(reader, message)
    assert isinstance(general, str) and error in general


def test_a_value_no_rule_bounds_is_read_even_when_it_is_not_a_number() -> None:
    reader = _reader()
    message = _message(dict(GOOD, free=[math.nan]))
    general = _general(reader, message)
    assert not isinstance(general, str)  # (no range: the general way takes it)
    found = reader.read(message)
    if found is not None:  # (a NaN may take the general way; if read here, read alike)
        same(found, general)


@pytest.mark.parametrize(
    "raws",
    [
        {"age": b"\x01" * 7},
        {"age": b"\x01" * 16},
        {"text": b"\x05\x00\x00\x00abc"},
        {"text": b"\x01\x00\x00\x00a\x01\x00\x00\x00b"},
        {"plan": b"\x01\x00"},
    ],
)
def test_buffers_of_another_length_go_the_general_way(raws: dict[str, bytes]) -> None:
    reader = _reader()
    message = _message(GOOD, raws=raws)
    assert reader.read(message) is None
    assert isinstance(_general(reader, message), str)


def test_inputs_with_parameters_or_typed_contents_are_not_kept() -> None:
    reader = LayoutReader(CONFIG, InputPlan(CONFIG))
    message = _message(GOOD)
    message.inputs[0].parameters["note"].string_param = "x"
    _learnt(reader, message)
    assert reader.read(message) is None
    typed = schema.ModelInferRequest(model_name="m")
    typed.inputs.add(name="age", datatype="INT64", shape=[1, 1]).contents.int64_contents.append(3)
    one = parse_model_config(
        {
            "name": "one",
            "runtime": "python",
            "max_batch_size": 4,
            "inputs": [INPUTS[0]],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        },
        source="test",
    )
    reader = LayoutReader(one, InputPlan(one))
    _learnt(reader, typed)
    assert reader.read(typed) is None  # (no raw contents: the general way)


def test_a_layout_is_kept_once_a_recent_request_had_it_too() -> None:
    # Token sequences of every length (a layout a call) are never kept; two clients' layouts
    # interleaved are both kept on their second requests.
    reader = LayoutReader(CONFIG, InputPlan(CONFIG))
    lengths = range(1, SEEN + 3)
    for n in lengths:
        message = _message(dict(GOOD, tokens=list(range(n))))
        assert reader.learn(message, decode_request(message).inputs) is not None
    assert all(reader.read(_message(dict(GOOD, tokens=list(range(n))))) is None for n in lengths)
    one, other = (_message(dict(GOOD, tokens=list(range(n)))) for n in (20, 21))
    for message in (one, other, one, other):
        assert reader.read(message) is None
        assert reader.learn(message, decode_request(message).inputs) is not None
    assert reader.read(one) is not None and reader.read(other) is not None
    # (the first lengths were let go of: one of them again is not yet kept)
    first = _message(dict(GOOD, tokens=[0]))
    reader.learn(first, decode_request(first).inputs)
    assert reader.read(first) is None


def test_a_request_that_fails_its_check_is_not_learnt() -> None:
    reader = LayoutReader(CONFIG, InputPlan(CONFIG))
    bad = _message(dict(GOOD, age=[500]))
    for _ in range(2):
        assert reader.learn(bad, decode_request(bad).inputs) is None
    assert reader.read(_message(GOOD)) is None


def test_the_newest_layouts_are_kept() -> None:
    reader = LayoutReader(CONFIG, InputPlan(CONFIG))
    messages = [_message(dict(GOOD, tokens=list(range(n)))) for n in range(1, KEPT + 2)]
    for message in messages:
        _learnt(reader, message)
    assert reader.read(messages[0]) is None  # (the oldest, let go)
    for message in messages[1:]:
        assert reader.read(message) is not None


def test_models_it_cannot_judge_have_no_reader() -> None:
    assert reader_for(UNBATCHED, InputPlan(UNBATCHED)) is None
    plan = InputPlan(CONFIG)
    assert reader_for(CONFIG, plan) is reader_for(CONFIG, plan)


@st.composite
def _messages(draw: st.DrawFn) -> Any:
    """A message of the learnt layout (one row; four tokens), with up to three values on or
    past their bounds, or a buffer cut short or grown."""
    values = {
        name: draw(st.lists(valid, min_size=len(GOOD[name]), max_size=len(GOOD[name])))
        for name, valid in VALID.items()
    }
    for name in draw(st.lists(st.sampled_from(sorted(EDGES)), max_size=3)):
        at = draw(st.integers(0, len(values[name]) - 1))
        values[name][at] = draw(st.sampled_from(EDGES[name]))
    raws: dict[str, bytes] = {}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(VALID)))
        buffer = raw(SPECS[name]["datatype"], values[name])
        cut = draw(st.integers(-3, 3))
        raws[name] = buffer[:cut] if cut < 0 else buffer + b"\x00" * cut
    return _message(values, raws=raws)


READER = _reader()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_messages())
def test_any_request_of_a_kept_layout_is_read_alike_or_left_to_the_general_way(
    message: Any,
) -> None:
    found = READER.read(message)
    if found is None:
        return
    general = _general(READER, message)
    assert not isinstance(general, str), general
    same(found, general)
