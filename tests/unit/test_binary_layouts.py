"""The HTTP binary reader against the general way: the same request, or none at all.

Once a binary request's JSON header has come twice, a request with the same header bytes (only
the raw bytes after it differing) is either read by the reader exactly as the general decoder
and the model's input plan would read it (the same tensors and parameters, checked arrays, rows
and batching group, the same id and outputs) or left to the general way, which says what is
wrong.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.layouts import CONFIG, EDGES, GOOD, SPECS, UNBATCHED, VALID, raw, same
from tailserve.engine.messages import InferRequest
from tailserve.engine.validation import Checked, InputPlan
from tailserve.errors import InvalidInput
from tailserve.modelconfig import parse_model_config
from tailserve.protocols.http import oip
from tailserve.protocols.http.binary_layouts import (
    KEPT,
    LONGEST,
    SEEN,
    BinaryReader,
    reader_for,
)
from tailserve.tensors import Tensor

Body = tuple[bytes, int]  # (the body, its header's length)


def _body(
    values: dict[str, list[Any]],
    *,
    raws: dict[str, bytes] | None = None,
    sizes: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
    parameters: dict[str, Any] | None = None,
) -> Body:
    """A binary request of ``values``; ``raws``: buffers sent instead, ``sizes``: sizes the
    header claims instead, ``extra``: more of the header, ``parameters``: more of the first
    input's."""
    raws, sizes = raws or {}, sizes or {}
    inputs: list[dict[str, Any]] = []
    buffers: list[bytes] = []
    for name, data in values.items():
        spec = SPECS[name]
        width = 3 if name == "vec" else len(data)
        buffer = raws.get(name, raw(spec["datatype"], data))
        given_parameters = {"binary_data_size": sizes.get(name, len(buffer))}
        if not inputs:
            given_parameters.update(parameters or {})
        inputs.append(
            {
                "name": name,
                "datatype": spec["datatype"],
                "shape": [max(1, len(data) // width), width],
                "parameters": given_parameters,
            }
        )
        buffers.append(buffer)
    header = json.dumps({"id": "r1", "inputs": inputs, **(extra or {})}).encode()
    return header + b"".join(buffers), len(header)


def _learn(reader: BinaryReader, body: Body) -> InferRequest:
    request = oip.decode_request("m", None, *body)
    reader.learn(*body, request)
    return request


def _reader(*bodies: Body) -> BinaryReader:
    reader = BinaryReader(CONFIG, InputPlan(CONFIG))
    for body in bodies or (_body(GOOD),):
        for _ in range(2):  # (a header is kept the second time)
            _learn(reader, body)
    return reader


def _read(reader: BinaryReader, body: Body) -> InferRequest | None:
    return reader.read("m", None, *body)


def _general(reader: BinaryReader, body: Body) -> tuple[list[Tensor], Checked] | str:
    try:
        inputs = oip.decode_request("m", None, *body).inputs
        return inputs, reader.plan.check(inputs)
    except InvalidInput as exc:
        return exc.message


def _same_request(request: InferRequest, reader: BinaryReader, body: Body) -> None:
    general = _general(reader, body)
    assert not isinstance(general, str), general
    assert request.checked is not None and request.checked[0] is reader.plan
    same((request.inputs, request.checked[1]), general)
    expected = oip.decode_request("m", None, *body)
    assert (request.model, request.id, request.parameters) == (
        "m",
        expected.id,
        expected.parameters,
    )
    assert request.outputs == expected.outputs


def test_a_header_met_twice_is_read_in_one_pass_as_the_general_way_reads_it() -> None:
    extra = {"outputs": [{"name": "y", "parameters": {"binary_data": True}}]}
    reader = _reader(_body(GOOD, extra=extra))
    other = dict(GOOD, age=[120], spend=[0.0], plan=[b"a"], text=[b"olleh"], tokens=[0, 999, 3, 4])
    body = _body(other, extra=extra)
    request = _read(reader, body)
    assert request is not None
    _same_request(request, reader, body)
    assert request.inputs[0].data.tolist() == [[120]]
    assert request.inputs[0].parameters == {"binary_data_size": 8}


def test_the_general_way_leaves_its_requests_checked_or_not_at_all() -> None:
    reader = BinaryReader(CONFIG, InputPlan(CONFIG))
    good = _learn(reader, _body(GOOD))
    assert good.checked is not None and good.checked[0] is reader.plan
    assert _learn(reader, _body(dict(GOOD, age=[500]))).checked is None


def test_a_header_not_met_goes_the_general_way() -> None:
    assert _read(BinaryReader(CONFIG, InputPlan(CONFIG)), _body(GOOD)) is None
    learnt = _reader()
    assert _read(learnt, _body(dict(GOOD, tokens=[1, 2, 3, 4, 5]))) is None
    assert _read(learnt, _body({k: v for k, v in GOOD.items() if k != "flag"})) is None
    assert _read(learnt, _body(GOOD, extra={"parameters": {"priority": 2}})) is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"age": [121]}, "outside the allowed range"),
        ({"age": [0]}, "outside the allowed range"),
        ({"small": [201]}, "outside the allowed range"),
        ({"spend": [0.10000001]}, "outside the allowed range"),
        ({"exact": [float("nan")]}, "outside the allowed range"),
        ({"plan": [b"c"]}, "unknown value"),
        ({"tokens": [5, 6, 7, 1000]}, "outside the allowed range"),
    ],
)
def test_a_value_the_model_refuses_goes_the_general_way(
    change: dict[str, list[Any]], error: str
) -> None:
    reader = _reader()
    body = _body(dict(GOOD, **change))
    assert _read(reader, body) is None
    general = _general(reader, body)
    assert isinstance(general, str) and error in general


@pytest.mark.parametrize(
    ("raws", "sizes"),
    [
        ({"age": b"\x01" * 7}, {"age": 8}),  # (the body a byte short of its header)
        ({"age": b"\x01" * 9}, {"age": 8}),  # (a byte left over)
        ({"text": b"\x06\x00\x00\x00abcde"}, {}),  # (an item claiming more than is there)
        ({"text": b"\x02\x00\x00\x00ab\x00\x00\x00"}, {}),  # (a second item cut short)
        ({"plan": b"\x02\x00\x00\x00"}, {"plan": 5}),  # (an item running past the data)
    ],
)
def test_bytes_that_do_not_fit_the_header_go_the_general_way(
    raws: dict[str, bytes], sizes: dict[str, int]
) -> None:
    reader = _reader()
    body = _body(GOOD, raws=raws, sizes=sizes)
    assert body[0][: body[1]] == _body(GOOD)[0][: body[1]]  # (the kept header, byte for byte)
    assert _read(reader, body) is None
    assert isinstance(_general(reader, body), str)


def test_a_body_held_in_a_bytearray_goes_the_general_way() -> None:
    body, header_length = _body(GOOD)
    assert _read(_reader(), (body, header_length)) is not None
    assert _read(_reader(), (bytearray(body), header_length)) is None
    reader = BinaryReader(CONFIG, InputPlan(CONFIG))
    for _ in range(2):
        _learn(reader, (bytearray(body), header_length))
    assert not reader.keeps(body[:header_length])


def test_a_header_past_the_longest_remembered_is_never_kept() -> None:
    long = _body(GOOD, extra={"parameters": {"note": "x" * LONGEST}})
    assert _read(_reader(long), long) is None
    assert _read(_reader(), _body(GOOD)) is not None


def test_inputs_with_other_parameters_or_json_data_are_not_kept() -> None:
    with_note = _body(GOOD, parameters={"note": "x"})
    assert _read(_reader(with_note), with_note) is None
    header = json.dumps(
        {"inputs": [{"name": "age", "datatype": "INT64", "shape": [1, 1], "data": [3]}]}
    ).encode()
    one = parse_model_config(
        {
            "name": "one",
            "runtime": "python",
            "max_batch_size": 4,
            "inputs": [{"name": "age", "datatype": "INT64", "shape": [1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        },
        source="test",
    )
    reader = BinaryReader(one, InputPlan(one))
    for _ in range(2):
        reader.learn(header, len(header), oip.decode_request("one", None, header, len(header)))
    assert reader.read("one", None, header, len(header)) is None


def test_a_header_is_kept_once_a_recent_request_had_it_too() -> None:
    # Headers with an id of their own each (never the same twice) are never kept; two
    # clients' headers interleaved are both kept on their second requests.
    reader = BinaryReader(CONFIG, InputPlan(CONFIG))
    for n in range(SEEN + 2):
        _learn(reader, _body(GOOD, extra={"id": f"request-{n}"}))
    assert all(
        _read(reader, _body(GOOD, extra={"id": f"request-{n}"})) is None for n in range(SEEN + 2)
    )
    one, other = (_body(dict(GOOD, tokens=list(range(n)))) for n in (20, 21))
    for body in (one, other, one, other):
        assert _read(reader, body) is None
        _learn(reader, body)
    assert _read(reader, one) is not None and _read(reader, other) is not None


def test_the_newest_headers_are_kept() -> None:
    bodies = [_body(dict(GOOD, tokens=list(range(n)))) for n in range(1, KEPT + 2)]
    reader = _reader(*bodies)
    assert _read(reader, bodies[0]) is None  # (the oldest, let go)
    assert all(_read(reader, body) is not None for body in bodies[1:])


def test_models_it_cannot_judge_have_no_reader() -> None:
    assert reader_for(UNBATCHED, InputPlan(UNBATCHED)) is None
    plan = InputPlan(CONFIG)
    assert reader_for(CONFIG, plan) is reader_for(CONFIG, plan)


# BYTES values of the learnt header's sizes (a BYTES item's length is in the header).
_SIZED = dict(VALID, text=st.binary(min_size=5, max_size=5))
_SIZED_EDGES = dict(EDGES, plan=[b"c", b"A"], text=[b"\x00\xff\x00\xff\x00"])


@st.composite
def _bodies(draw: st.DrawFn) -> Body:
    """A body under the learnt header (one row; four tokens), with up to three values on or
    past their bounds, or a buffer cut short or grown under the same header."""
    values = {
        name: draw(st.lists(valid, min_size=len(GOOD[name]), max_size=len(GOOD[name])))
        for name, valid in _SIZED.items()
    }
    for name in draw(st.lists(st.sampled_from(sorted(_SIZED_EDGES)), max_size=3)):
        at = draw(st.integers(0, len(values[name]) - 1))
        values[name][at] = draw(st.sampled_from(_SIZED_EDGES[name]))
    raws: dict[str, bytes] = {}
    sizes: dict[str, int] = {}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(_SIZED)))
        buffer = raw(SPECS[name]["datatype"], values[name])
        cut = draw(st.integers(-3, 3))
        raws[name] = buffer[:cut] if cut < 0 else buffer + b"\x00" * cut
        sizes[name] = len(buffer)
    return _body(values, raws=raws, sizes=sizes)


READER = _reader()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies())
def test_any_request_under_a_kept_header_is_read_alike_or_left_to_the_general_way(
    body: Body,
) -> None:
    request = _read(READER, body)
    if request is None:
        return
    _same_request(request, READER, body)
