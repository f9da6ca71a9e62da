"""Properties of the binary tensor extension's codec (tensors.py, protocols/http/oip.py): what
is encoded decodes to the same tensor, for every datatype; any bytes, sizes and header lengths
a client sends give InvalidInput (a 400 naming the problem), never another exception."""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import hypothesis.strategies as st
import numpy as np
import orjson
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp

from support import fuzzing
from tailserve.errors import InvalidInput
from tailserve.protocols.http.oip import decode_request, encode_response
from tailserve.tensors import DATATYPES, Tensor, from_binary, from_json, to_binary, to_json_data

_NUMERIC = [name for name in DATATYPES if name != "BYTES"]
_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def arrays(draw: st.DrawFn, datatype: str | None = None) -> tuple[str, np.ndarray[Any, Any]]:
    datatype = datatype or draw(st.sampled_from(list(DATATYPES)))
    shape = draw(_shapes)
    if datatype == "BYTES":
        items = draw(
            st.lists(
                st.binary(max_size=12), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))
            )
        )
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return datatype, array.reshape(shape)
    return datatype, draw(hnp.arrays(DATATYPES[datatype], shape))


def _tally(target: str) -> None:
    fuzzing.CASES[f"codec {target}"] += 1


def _same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "O":
        return a.reshape(-1).tolist() == b.reshape(-1).tolist()
    # Bit for bit: NaNs and signed zeros round-trip too.
    return a.tobytes() == np.ascontiguousarray(b, dtype=a.dtype).tobytes()


@given(arrays())
@settings(fuzzing.PROFILE)
def test_binary_round_trip(drawn: tuple[str, np.ndarray[Any, Any]]) -> None:
    _tally("binary round trip")
    datatype, array = drawn
    decoded = from_binary("x", datatype, list(array.shape), to_binary(array))
    assert _same(array, decoded)


@given(arrays(), st.booleans())
@settings(fuzzing.PROFILE)
def test_request_round_trip_through_the_binary_body(
    drawn: tuple[str, np.ndarray[Any, Any]], also_json: bool
) -> None:
    # What a client (tritonclient) sends: the header, then the raw tensors, one JSON as well.
    _tally("request round trip")
    datatype, array = drawn
    raw = to_binary(array)
    inputs: list[dict[str, Any]] = [
        {
            "name": "b",
            "datatype": datatype,
            "shape": list(array.shape),
            "parameters": {"binary_data_size": len(raw)},
        },
    ]
    # (JSON has no NaN or infinity: such data goes binary.)
    finite = array.dtype.kind != "f" or bool(np.isfinite(array).all())
    if also_json and datatype != "BYTES" and finite:
        inputs.append(
            {
                "name": "j",
                "datatype": datatype,
                "shape": list(array.shape),
                "data": to_json_data(array),
            }
        )
    header = orjson.dumps({"inputs": inputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    request = decode_request("m", None, header + raw, len(header))
    assert _same(array, request.inputs[0].data)
    if len(inputs) == 2:
        assert np.array_equal(request.inputs[1].data, array.astype(request.inputs[1].data.dtype))


@given(arrays())
@settings(fuzzing.PROFILE)
def test_response_round_trip(drawn: tuple[str, np.ndarray[Any, Any]]) -> None:
    _tally("response round trip")
    from tailserve.engine.messages import InferRequest, InferResponse

    datatype, array = drawn
    request = InferRequest(model="m", inputs=[], parameters={"binary_data_output": True})
    response = InferResponse(model="m", version="1", outputs=[Tensor("y", datatype, array)])
    body, headers = encode_response(request, response)
    length = int(dict(headers)[b"inference-header-content-length"])
    document = orjson.loads(body[:length])
    (output,) = document["outputs"]
    decoded = from_binary("y", output["datatype"], output["shape"], body[length:])
    assert _same(array, decoded)


@given(
    st.sampled_from([*DATATYPES, "FP8", "", "int32"]),
    st.lists(st.integers(-3, 2**40), max_size=6),
    st.binary(max_size=64),
)
@settings(fuzzing.PROFILE)
def test_any_bytes_decode_or_say_why(datatype: str, shape: list[int], raw: bytes) -> None:
    _tally("from_binary any bytes")
    try:
        array = from_binary("x", datatype, shape, raw)
    except InvalidInput:
        return
    assert list(array.shape) == shape


@given(
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=8)), max_size=5),
    st.integers(0, 3),
)
@settings(fuzzing.PROFILE)
def test_bytes_items_with_any_length_prefix(items: list[tuple[int, bytes]], cut: int) -> None:
    _tally("BYTES length prefixes")
    raw = b"".join(struct.pack("<I", n) + data for n, data in items)
    raw = raw[: len(raw) - cut] if cut else raw
    with contextlib.suppress(InvalidInput):
        from_binary("x", "BYTES", [len(items)], raw)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, int | None]:
    """A binary-extension body with its parts drawn at random: sizes, shapes, datatypes,
    parameters, the header length, and bytes cut or added."""
    inputs = []
    for _ in range(draw(st.integers(0, 3))):
        entry: dict[str, Any] = {
            "name": draw(st.text(max_size=4)),
            "datatype": draw(st.sampled_from([*DATATYPES, "NOPE"])),
            "shape": draw(st.lists(st.integers(-2, 8), max_size=3)),
        }
        size = draw(st.one_of(st.none(), st.integers(-4, 80), _json_values))
        if size is not None:
            entry["parameters"] = {"binary_data_size": size}
        if draw(st.booleans()):
            entry["data"] = draw(_json_values)
        inputs.append(entry)
    document: dict[str, Any] = {"inputs": inputs}
    if draw(st.booleans()):
        document["parameters"] = draw(
            st.dictionaries(
                st.sampled_from(["binary_data_output", "timeout", "priority", "cache", "x"]),
                _json_values,
                max_size=3,
            )
        )
    if draw(st.booleans()):
        document["outputs"] = [{"name": "y", "parameters": {"binary_data": draw(_json_values)}}]
    header = json.dumps(document).encode()  # (integers past 64 bits too)
    if draw(st.booleans()):
        header = draw(st.binary(max_size=40))  # not JSON at all
    tail = draw(st.binary(max_size=80))
    body = header + tail
    length = draw(st.one_of(st.just(len(header)), st.none(), st.integers(-5, len(body) + 5)))
    return body, length


@given(bodies())
@settings(fuzzing.PROFILE)
def test_any_binary_body_decodes_or_says_why(drawn: tuple[bytes, int | None]) -> None:
    _tally("decode_request any body")
    body, length = drawn
    with contextlib.suppress(InvalidInput):
        decode_request("m", None, body, length)


@given(st.sampled_from(list(DATATYPES)), st.lists(st.integers(0, 6), max_size=3), _json_values)
@settings(fuzzing.PROFILE)
def test_any_json_data_decodes_or_says_why(datatype: str, shape: list[int], data: Any) -> None:
    _tally("from_json any data")
    with contextlib.suppress(InvalidInput):
        from_json("x", datatype, shape, data)
