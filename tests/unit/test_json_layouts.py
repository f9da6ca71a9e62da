"""The typed decoder's kept layouts against the general way: the same request, or none at all.

Once two bodies of a layout (the same inputs in the same order, shapes and no parameters) have
been decoded input by input, a later body of that layout has each datatype's values made into
one array: it must give exactly what the general decoder and the model's input plan give (the
same tensors, checked arrays, rows and batching group, the same request fields), or leave the
body to the typed decoder's own way, which declines what it cannot judge.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.layouts import CONFIG, EDGES, GOOD, INPUTS, VALID, same
from tailserve.engine.messages import InferRequest
from tailserve.engine.validation import InputPlan
from tailserve.errors import InvalidInput
from tailserve.protocols.http import oip
from tailserve.protocols.http.oip_typed import TypedDecoder
from tailserve.protocols.layouts import KEPT, SEEN

# JSON carries text, not bytes.
_GOOD = {
    name: [v.decode() if isinstance(v, bytes) else v for v in data] for name, data in GOOD.items()
}
_TEXT = st.sampled_from(["", "a", "hello", "é"])
# (floats past 2**53 go the general way from the typed decoder: within it here)
_FLOATS = st.floats(-1e6, 1e6, width=32)
_VALID = dict(VALID, plan=st.sampled_from(["a", "b"]), text=_TEXT, free=_FLOATS, vec=_FLOATS)
_EDGES = dict(EDGES, plan=["c", "A"], text=[""])
_WIDTH = {"vec": 3}


def _body(
    values: dict[str, list[Any]],
    *,
    rows: int = 1,
    order: list[str] | None = None,
    shapes: dict[str, Any] | None = None,
    parameters: dict[str, dict[str, Any]] | None = None,
    **extra: Any,
) -> bytes:
    shapes, parameters = shapes or {}, parameters or {}
    inputs = []
    for name in order or [spec["name"] for spec in INPUTS]:
        if name not in values:
            continue
        data = values[name]
        datatype = next(spec["datatype"] for spec in INPUTS if spec["name"] == name)
        item = {
            "name": name,
            "datatype": datatype,
            "shape": shapes.get(name, [rows, len(data) // rows]),
            "data": data,
        }
        if name in parameters:
            item["parameters"] = parameters[name]
        inputs.append(item)
    return json.dumps({"inputs": inputs, **extra}).encode()


def _decoder(*bodies: bytes) -> TypedDecoder:
    decoder = TypedDecoder(CONFIG, InputPlan(CONFIG))
    for body in bodies or (_body(_GOOD),):
        for _ in range(2):  # (a layout is kept the second time)
            assert decoder.decode("m", None, body) is not None
    return decoder


def _same_as_general(decoder: TypedDecoder, request: InferRequest, body: bytes) -> None:
    try:
        general = oip.decode_request("m", None, body, None)
        checked = decoder.plan.check(general.inputs)
    except InvalidInput as exc:
        raise AssertionError(f"read, where the general way says: {exc.message}") from None
    assert request.checked is not None and request.checked[0] is decoder.plan
    same((request.inputs, request.checked[1]), (general.inputs, checked))
    assert (request.id, request.outputs) == (general.id, general.outputs)
    assert request.parameters == general.parameters


def test_a_layout_met_twice_is_read_in_one_pass_as_the_general_way_reads_it() -> None:
    decoder = _decoder()
    assert len(decoder.layouts) == 1
    other = dict(_GOOD, age=[120], spend=[0.0], plan=["a"], text=[""], tokens=[0, 999, 3, 4])
    body = _body(other, id="r2", outputs=[{"name": "y"}], parameters={"timeout": 5})
    request = decoder.decode("m", None, body)
    assert request is not None
    _same_as_general(decoder, request, body)
    assert request.inputs[0].data.tolist() == [[120]]


def test_several_rows_and_columns_sent_flat() -> None:
    two = {name: data * 2 for name, data in _GOOD.items()}
    flat = {name: [2] for name, data in _GOOD.items() if len(data) == 1}
    decoder = _decoder(_body(two, rows=2), _body(two, rows=2, shapes=flat))
    assert len(decoder.layouts) == 2
    for body in (_body(two, rows=2), _body(two, rows=2, shapes=flat)):
        request = decoder.decode("m", None, body)
        assert request is not None
        _same_as_general(decoder, request, body)


def test_a_body_that_does_not_fill_its_layout_goes_the_typed_decoders_way() -> None:
    decoder = _decoder()
    for body in (
        _body(dict(_GOOD, vec=[1, 2, 3, 4]), shapes={"vec": [1, 3]}),  # (values past the shape)
        _body(dict(_GOOD, tokens=[1, 2, 3]), shapes={"tokens": [1, 4]}),  # (values short)
        _body(_GOOD, order=[spec["name"] for spec in reversed(INPUTS)]),  # (another order)
        _body(_GOOD, parameters={"age": {"note": "x"}}),  # (an input's parameters)
        _body({name: data for name, data in _GOOD.items() if name != "flag"}),  # (one less)
    ):
        decoder.decode("m", None, body)  # (the typed decoder's way: read or declined)
        assert len(decoder.layouts) == 1  # (nothing new learnt from a single body)
    assert (
        decoder.decode("m", None, _body(dict(_GOOD, vec=[1, 2, 3, 4]), shapes={"vec": [1, 3]}))
        is None
    )


def test_a_layout_is_kept_once_a_recent_body_had_it_too() -> None:
    # Token sequences of every length (a layout a body) are never kept; two clients' layouts
    # interleaved are both kept on their second bodies.
    decoder = TypedDecoder(CONFIG, InputPlan(CONFIG))
    for n in range(1, SEEN + 3):
        assert decoder.decode("m", None, _body(dict(_GOOD, tokens=list(range(n))))) is not None
    assert len(decoder.layouts) == 0
    one, other = (_body(dict(_GOOD, tokens=list(range(n)))) for n in (20, 21))
    for body in (one, other, one, other):
        decoder.decode("m", None, body)
    assert len(decoder.layouts) == 2


def test_the_newest_layouts_of_the_same_inputs_are_kept() -> None:
    bodies = [_body(dict(_GOOD, tokens=list(range(n)))) for n in range(1, KEPT + 2)]
    decoder = _decoder(*bodies)
    assert len(decoder.layouts) == KEPT


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """A body of a learnt layout (one or two rows; four tokens a row), with up to two values
    on or past their bounds or of another kind, or an input with one too many or too few."""
    rows = draw(st.integers(1, 2))
    values = {
        name: draw(
            st.lists(valid, min_size=rows * len(_GOOD[name]), max_size=rows * len(_GOOD[name]))
        )
        for name, valid in _VALID.items()
    }
    for name in draw(st.lists(st.sampled_from(sorted(_EDGES)), max_size=2)):
        at = draw(st.integers(0, len(values[name]) - 1))
        values[name][at] = draw(st.sampled_from([*_EDGES[name], None, "x", 1.5, 2**64]))
    shapes = {name: [rows, len(data)] for name, data in _GOOD.items()}
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(sorted(values)))
        if draw(st.booleans()):
            values[name].append(values[name][0])
        elif len(values[name]) > 1:
            values[name].pop()
    return _body(values, rows=rows, shapes=shapes)


DECODER = _decoder(
    *(_body({name: data * rows for name, data in _GOOD.items()}, rows=rows) for rows in (1, 2))
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies())
def test_any_body_of_a_kept_layout_is_read_alike_or_left_to_the_general_way(body: bytes) -> None:
    request = DECODER.decode("m", None, body)
    if request is None:
        return
    _same_as_general(DECODER, request, body)
