"""A model's typed decoder against the general path: the same request, or none at all.

For any body, the typed decoder either declines (None: the general path reads it, and says
what is wrong) or gives what the general decoder and the model's input plan give together:
the same tensors, the same checked arrays, rows and batching group, the same request fields.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.layouts import UNBATCHED
from tailserve.engine.messages import InferRequest
from tailserve.engine.validation import Checked, InputPlan
from tailserve.errors import InvalidInput
from tailserve.modelconfig import parse_model_config
from tailserve.protocols.http import oip
from tailserve.protocols.http.oip_typed import decoder_for, takes

INPUTS: list[dict[str, Any]] = [
    {"name": "age", "datatype": "INT64", "shape": [1], "range": [1, 120]},
    {"name": "spend", "datatype": "FP32", "shape": [1], "range": [0, 0.1]},
    {"name": "free", "datatype": "FP32", "shape": [1]},
    {"name": "exact", "datatype": "FP64", "shape": [1], "range": [-1.5, 1.5]},
    {"name": "half", "datatype": "FP16", "shape": [1]},
    {"name": "small", "datatype": "UINT8", "shape": [1]},
    {"name": "big", "datatype": "UINT64", "shape": [1]},
    {"name": "plan", "datatype": "BYTES", "shape": [1], "values": ["a", "b"]},
    {"name": "text", "datatype": "BYTES", "shape": [1]},
    {"name": "flag", "datatype": "BOOL", "shape": [1]},
    {"name": "vec", "datatype": "FP32", "shape": [3]},
    {"name": "tokens", "datatype": "INT64", "shape": [-1], "range": [0, 999]},
    {"name": "extra", "datatype": "INT32", "shape": [1], "optional": True},
]
CONFIG = parse_model_config(
    {
        "name": "m",
        "runtime": "python",
        "max_batch_size": 4,
        "inputs": INPUTS,
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    },
    source="test",
)
PLAN = InputPlan(CONFIG)
DECODER = decoder_for(CONFIG, PLAN)

GOOD = {
    "age": [30],
    "spend": [0.05],
    "free": [-1e10],
    "exact": [1.25],
    "half": [2.5],
    "small": [255],
    "big": [2**40],
    "plan": ["b"],
    "text": ["hello"],
    "flag": [True],
    "vec": [1, 2.5, -3],
    "tokens": [5, 6, 7, 8],
}


def _body(
    values: dict[str, list[Any]], shapes: dict[str, Any] | None = None, **extra: Any
) -> bytes:
    shapes = shapes or {}
    inputs = []
    for spec in INPUTS:
        if spec["name"] not in values:
            continue
        data = values[spec["name"]]
        rows = max(1, len(data) // 3) if spec["name"] == "vec" else 1
        shape = shapes.get(spec["name"], [rows, len(data) // rows])
        name, datatype = spec["name"], spec["datatype"]
        inputs.append({"name": name, "datatype": datatype, "shape": shape, "data": data})
    return json.dumps({"inputs": inputs, **extra}).encode()


def _general(body: bytes) -> tuple[InferRequest, Checked] | InvalidInput:
    try:
        request = oip.decode_request("m", None, body, None)
        return request, PLAN.check(request.inputs)
    except InvalidInput as exc:
        return exc


def _same(typed: InferRequest, general: InferRequest, checked: Checked) -> None:
    assert typed.checked is not None and typed.checked[0] is PLAN
    mine = typed.checked[1]
    assert (mine.rows, mine.group) == (checked.rows, checked.group)
    assert list(mine.arrays) == list(checked.arrays)
    for name, array in checked.arrays.items():
        _same_array(mine.arrays[name], array)
    assert [t.name for t in typed.inputs] == [t.name for t in general.inputs]
    for a, b in zip(typed.inputs, general.inputs, strict=True):
        assert (a.datatype, a.parameters) == (b.datatype, b.parameters)
        _same_array(a.data, b.data)
    assert (typed.id, typed.parameters) == (general.id, general.parameters)
    assert typed.outputs == general.outputs


def _same_array(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert a.tolist() == b.tolist()


def test_a_well_formed_body_takes_the_typed_path_and_matches_the_general_one() -> None:
    assert DECODER is not None
    body = _body(GOOD, id="r1", outputs=[{"name": "y"}], parameters={"timeout": 5000})
    typed = DECODER.decode("m", None, body)
    assert typed is not None
    general = _general(body)
    assert not isinstance(general, InvalidInput)
    _same(typed, *general)


def test_columns_sent_flat_and_several_rows() -> None:
    assert DECODER is not None
    rows = {name: values * 2 for name, values in GOOD.items() if name != "tokens"}
    rows["tokens"] = [1, 2, 3, 4, 5, 6]
    shapes = {name: [2] for name in rows if name not in ("vec", "tokens")}
    shapes["vec"] = [2, 3]
    shapes["tokens"] = [2, 3]
    body = _body(rows, shapes)
    typed = DECODER.decode("m", None, body)
    assert typed is not None and typed.checked is not None
    assert typed.checked[1].rows == 2
    general = _general(body)
    assert not isinstance(general, InvalidInput)
    _same(typed, *general)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"age": [0]}, "outside the allowed range"),
        ({"age": [30.0]}, "cannot hold"),
        ({"plan": ["c"]}, "unknown value"),
        ({"small": [256]}, "does not fit"),
        ({"half": [1e6]}, "does not fit"),
        ({"flag": [1]}, None),  # (the general path takes 0 and 1 as BOOL)
        ({"free": [1e20]}, None),  # (past 2**53: the general path narrows it)
        ({"text": [1]}, "must be strings"),
    ],
)
def test_what_the_typed_path_declines_the_general_path_judges(
    change: dict[str, list[Any]], message: str | None
) -> None:
    assert DECODER is not None
    body = _body({**GOOD, **change})
    assert DECODER.decode("m", None, body) is None
    general = _general(body)
    if message is None:
        assert not isinstance(general, InvalidInput)
    else:
        assert isinstance(general, InvalidInput) and message in general.message


def test_the_top_half_of_uint64_goes_the_general_way() -> None:
    assert DECODER is not None
    body = _body({**GOOD, "big": [2**64 - 1]})
    assert DECODER.decode("m", None, body) is None
    general = _general(body)
    assert not isinstance(general, InvalidInput)
    assert general[1].arrays["big"].tolist() == [[2**64 - 1]]


def test_missing_duplicate_and_unknown_inputs_go_the_general_way() -> None:
    assert DECODER is not None
    missing = {name: v for name, v in GOOD.items() if name != "age"}
    document = orjson.loads(_body(GOOD))
    twice = {"inputs": [*document["inputs"], document["inputs"][0]]}
    unknown = {"inputs": [*document["inputs"], {**document["inputs"][0], "name": "who"}]}
    for body in (_body(missing), orjson.dumps(twice), orjson.dumps(unknown)):
        assert DECODER.decode("m", None, body) is None
        assert isinstance(_general(body), InvalidInput)


def test_models_it_cannot_judge_have_none() -> None:
    assert not takes(UNBATCHED)
    assert decoder_for(UNBATCHED, InputPlan(UNBATCHED)) is None


_WILD = st.one_of(
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.sampled_from(["a", "b", "c", "hello", ""]),
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
# Values near what each input takes: inside, on and just past its bounds.


# What each input takes, and values on and just past its bounds.
_VALID: dict[str, st.SearchStrategy[Any]] = {
    "age": st.integers(1, 120),
    "spend": st.floats(0, 0.1),
    "free": st.floats(-1e30, 1e30),
    "exact": st.one_of(st.floats(-1.5, 1.5), st.integers(-1, 1)),
    "half": st.floats(-65504, 65504),
    "small": st.integers(0, 255),
    "big": st.integers(0, 2**63),
    "plan": st.sampled_from(["a", "b"]),
    "text": st.text(max_size=5),
    "flag": st.booleans(),
    "vec": st.one_of(st.floats(-1e30, 1e30), st.integers(-(2**53), 2**53)),
    "tokens": st.integers(0, 999),
}
_EDGES: dict[str, list[Any]] = {
    "age": [0, 1, 120, 121],
    "spend": [0.1, 0.10000000149011612, 0.1000000089406967, -0.0, -1e-46, 1],
    "free": [2**53, 2**53 + 1, 1e39, 3.4028235e38, 3.4028236e38],
    "exact": [1.5, 1.5000000000000002, -1.5],
    "half": [65504.0, 65519.0, 65520.0, 1e-8, 6e-8],
    "small": [-1, 0, 255, 256],
    "big": [-1, 2**63 - 1, 2**63, 2**64 - 1, 2**64],
    "plan": ["c", "A"],
    "text": [""],
    "flag": [0, 1],
    "vec": [2**60 + 1, 1e300],
    "tokens": [-1, 0, 999, 1000],
}


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """A body of one or two rows, well formed but for up to two changes: a value on or past
    an input's bounds, a value of another kind, another shape, or an input left out."""
    rows = draw(st.integers(1, 2))
    values: dict[str, list[Any]] = {}
    shapes: dict[str, Any] = {}
    for name, valid in _VALID.items():
        width = 3 if name == "vec" else draw(st.integers(1, 70)) if name == "tokens" else 1
        count = rows * width
        values[name] = draw(st.lists(valid, min_size=count, max_size=count))
        flat = width == 1 and draw(st.booleans())
        shapes[name] = [rows] if flat else [rows, width]
    changes = st.tuples(st.sampled_from(sorted(_VALID)), st.integers(0, 3))
    for name, kind in draw(st.lists(changes, max_size=2)):
        if name not in values:
            continue
        at = draw(st.integers(0, len(values[name]) - 1))
        if kind == 0:
            values[name][at] = draw(st.sampled_from(_EDGES[name]))
        elif kind == 1:
            values[name][at] = draw(_WILD)
        elif kind == 2:
            shapes[name] = draw(st.lists(st.integers(-1, 4), min_size=1, max_size=3))
        else:
            del values[name]
    return _body(values, shapes)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies())
def test_any_body_is_read_alike_or_left_to_the_general_path(body: bytes) -> None:
    assert DECODER is not None
    typed = DECODER.decode("m", None, body)
    if typed is None:
        return
    general = _general(body)
    assert not isinstance(general, InvalidInput), general.message
    _same(typed, *general)
