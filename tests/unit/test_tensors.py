"""Tensor codecs: JSON and binary round trips, BYTES, FP16, and the errors they raise."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from tailserve.errors import InvalidInput
from tailserve.tensors import datatype_of, from_binary, from_json, to_binary, to_json_data

NUMERIC = [
    "BOOL",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "FP16",
    "FP32",
    "FP64",
]


@pytest.mark.parametrize("datatype", NUMERIC)
def test_binary_round_trip_keeps_values_and_shape(datatype: str) -> None:
    rng = np.random.default_rng(1)
    values = rng.integers(0, 2 if datatype == "BOOL" else 100, size=(3, 4))
    array = from_json("x", datatype, [3, 4], values.tolist())
    back = from_binary("x", datatype, [3, 4], to_binary(array))
    assert back.shape == (3, 4)
    assert datatype_of(back) == datatype
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("datatype", NUMERIC)
def test_json_round_trip_is_flat_row_major(datatype: str) -> None:
    nested = [[1, 0, 1], [0, 1, 1]]
    array = from_json("x", datatype, [2, 3], nested)
    flat = np.asarray(to_json_data(array)).tolist()
    assert flat == [1, 0, 1, 0, 1, 1] or flat == [True, False, True, False, True, True]


def test_flat_and_nested_json_give_the_same_tensor() -> None:
    a = from_json("x", "FP32", [2, 2], [1.5, 2.5, 3.5, 4.5])
    b = from_json("x", "FP32", [2, 2], [[1.5, 2.5], [3.5, 4.5]])
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32


def test_bytes_binary_is_length_prefixed_and_round_trips() -> None:
    array = from_json("s", "BYTES", [3], ["monthly", "", "multi-year ✓"])
    raw = to_binary(array)
    assert raw[:4] == struct.pack("<I", 7)
    assert raw[4:11] == b"monthly"
    back = from_binary("s", "BYTES", [3], raw)
    assert back.tolist() == [b"monthly", b"", "multi-year ✓".encode()]
    assert to_json_data(back) == ["monthly", "", "multi-year ✓"]


def test_fp16_json_output_is_serialisable_floats() -> None:
    array = from_json("h", "FP16", [2], [0.5, 1.25])
    assert array.dtype == np.float16
    assert np.asarray(to_json_data(array)).tolist() == [0.5, 1.25]


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "message"),
    [
        ("FP32", [2], [1.0, 2.0, 3.0], "needs 2 elements, data has 3"),
        ("INT64", [1], [1.5], "cannot hold float64"),
        ("FP32", [1], ["a"], "cannot hold non-numeric"),
        ("BYTES", [1], [5], "BYTES data must be strings"),
        ("FP99", [1], [1], "unknown datatype 'FP99'"),
        ("FP32", [-1], [1], "must hold integers >= 0"),
        ("FP32", [2], [[1.0], [2.0, 3.0]], "regular nested list"),
        ("UINT8", [1], [300], "does not fit datatype UINT8"),
        ("FP32", [1], None, "'data' is missing"),
    ],
)
def test_bad_json_tensors_name_the_tensor(
    datatype: str, shape: list[int], data: object, message: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        from_json("field_x", datatype, shape, data)
    assert "field_x" in info.value.message or "FP99" in info.value.message
    assert message in info.value.message


def test_binary_size_mismatch_is_an_error() -> None:
    with pytest.raises(InvalidInput, match="needs 8 bytes, got 4"):
        from_binary("x", "FP32", [2], b"\x00" * 4)
    with pytest.raises(InvalidInput, match="runs past the end"):
        from_binary("s", "BYTES", [1], struct.pack("<I", 10) + b"abc")


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([2**30, 2**29], "is too large"),  # every dimension counts
        ([2**30, 0, 2**29], "is too large"),  # a zero does not hide the others
        ([3, -1], "must hold integers >= 0"),
        ([1] * 33, "more than 32"),
    ],
)
def test_a_binary_tensor_of_an_impossible_shape_is_refused_by_its_shape(
    shape: list[int], message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        from_binary("x", "FP32", shape, b"")


def test_a_binary_tensor_with_a_zero_dimension_holds_nothing() -> None:
    assert from_binary("x", "FP32", [4, 0, 3], b"").shape == (4, 0, 3)
    assert from_binary("x", "FP32", [], b"\x00\x00\x80\x3f").item() == 1.0


SHORT_LISTS = [
    [3],
    [0, -7, 2**40],
    [2**63 - 1],
    [-(2**63)],
    [300],
    [-1],
    [1.5],
    [0.1, 2.5e38],
    [5, 2.5],
    [2**53],
    [2**53 + 1],
    [True],
    [True, 2],
    [1e300],
    [70000.0],
    ["a"],
    [None],
    [],
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e300 as FP16/FP32: inf
@pytest.mark.parametrize("datatype", NUMERIC)
@pytest.mark.parametrize("values", SHORT_LISTS, ids=str)
def test_a_short_list_decodes_as_the_general_path_decodes_it(
    datatype: str, values: list[object]
) -> None:
    # Short flat lists of plain numbers take a shortcut; past 64 values the general path
    # decodes. The same values, repeated past 64, must give the same array or the same error.
    many = values * 70
    general = _decoded(datatype, [len(many)], many)
    if isinstance(general, np.ndarray):
        general = general[: len(values)]
    # Flat, and as one row of a batch (what clients send for a model with rows).
    for shape in ([len(values)], [1, len(values)]):
        _assert_same(_decoded(datatype, shape, values), general, tuple(shape))


def _decoded(datatype: str, shape: list[int], values: object) -> np.ndarray | str:
    """The array, or the message of the error."""
    try:
        return from_json("x", datatype, shape, values)
    except InvalidInput as exc:
        return exc.message


def _assert_same(short: np.ndarray | str, general: np.ndarray | str, shape: tuple) -> None:
    if isinstance(general, str):
        assert isinstance(short, str) and short.split(":")[1] == general.split(":")[1]
        return
    assert isinstance(short, np.ndarray), short
    assert short.shape == shape
    assert short.dtype == general.dtype
    if short.dtype == np.dtype(object):
        assert short.reshape(-1).tolist() == general.reshape(-1).tolist()
    else:
        assert short.tobytes() == general.tobytes()


@pytest.mark.parametrize(
    "shape", [[2, 1], [1, 2], [-1, -2], [-2, -1], [2, -1], [1, 1, 2], [2, 0], [0, 2]], ids=str
)
def test_a_short_list_of_a_shape_that_does_not_count_it_takes_the_general_path(
    shape: list[int],
) -> None:
    # Two values fit [2, 1] and [1, 2]; negative dimensions whose product is 2 must still be
    # refused, and a shape of more dimensions decodes as the general path decodes it.
    values = [1.0, 2.0]
    try:
        array = from_json("x", "FP32", shape, values)
    except InvalidInput as exc:
        assert any(d < 0 for d in shape) or 0 in shape or len(shape) > 2, exc.message
        assert "x" in exc.message
    else:
        assert array.shape == tuple(shape)
        assert array.tolist() == np.array(values, dtype=np.float32).reshape(shape).tolist()


SHORT_TEXTS = [["a"], ["a", "bc"], [""], ["é", "x"], [5], ["a", None], [["a"]], [], ["a"] * 3]


@pytest.mark.parametrize("values", SHORT_TEXTS, ids=str)
def test_a_short_list_of_texts_decodes_as_the_general_path_decodes_it(values: list[object]) -> None:
    # The same shortcut for BYTES, flat and as one row; given three dimensions, the same values
    # take the general path.
    general = _decoded("BYTES", [1, 1, len(values)], values)
    if isinstance(general, np.ndarray):
        general = general[0][0]
    for shape in ([len(values)], [1, len(values)]):
        _assert_same(_decoded("BYTES", shape, values), general, tuple(shape))


@pytest.mark.parametrize("shape", [[0, 2**62], [2**62, 0], [0, 0], [0]], ids=str)
def test_an_empty_tensor_of_any_shape_is_checked_as_the_general_path_checks_it(
    shape: list[int],
) -> None:
    # No values, and a shape that holds none: a dimension past what numpy can shape is
    # refused by name, not left to fail inside numpy.
    if max(shape, default=0) > 2**40:
        with pytest.raises(InvalidInput, match="is too large"):
            from_json("x", "FP32", shape, [])
    else:
        assert from_json("x", "FP32", shape, []).shape == tuple(shape)


@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_int64_values_past_its_range_are_refused_not_wrapped(value: int) -> None:
    # numpy reads them as uint64, and the cast to int64 would wrap them to negative numbers.
    with pytest.raises(InvalidInput, match="does not fit datatype INT64"):
        from_json("x", "INT64", [1], [value])
    assert from_json("x", "INT64", [1], [2**63 - 1]).tolist() == [2**63 - 1]


@pytest.mark.parametrize(
    ("datatype", "data"),
    [("FP16", [1e10]), ("FP16", [70000.0] * 100), ("FP16", [[1e10]]), ("FP32", [1e300])],
)
def test_floats_past_the_type_range_are_refused_not_made_infinite(
    datatype: str, data: list[object]
) -> None:
    # Found by tests/fuzz: 1e10 as FP16 became inf, with only a numpy warning.
    shape = [1, 1] if isinstance(data[0], list) else [len(data)]
    with pytest.raises(InvalidInput, match=f"does not fit datatype {datatype}"):
        from_json("x", datatype, shape, data)
    assert np.isinf(from_json("x", datatype, [1], [float("inf")])).all()  # infinity itself is kept


def test_binary_is_little_endian_c_order_whatever_the_arrays_layout() -> None:
    values = np.arange(12, dtype=np.int32).reshape(3, 4)
    expected = b"".join(struct.pack("<i", int(v)) for v in values.reshape(-1))
    for array in (values, np.asfortranarray(values), values.astype(">i4"), values.T.T):
        assert to_binary(array) == expected
    assert to_binary(np.arange(8, dtype=np.int64)[::2]) == struct.pack("<4q", 0, 2, 4, 6)
    assert to_binary(np.array([True, False])) == b"\x01\x00"
