"""A model of every kind of input the layout readers judge (`protocols.layouts`), its good
values, values on and past its bounds, and the comparison of a layout's reading with the
general way's: shared by the gRPC and HTTP binary readers' tests."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tailserve.engine.validation import Checked
from tailserve.modelconfig import parse_model_config
from tailserve.tensors import DATATYPES, Tensor

INPUTS: list[dict[str, Any]] = [
    {"name": "age", "datatype": "INT64", "shape": [1], "range": [1, 120]},
    {"name": "spend", "datatype": "FP32", "shape": [1], "range": [0, 0.1]},
    {"name": "free", "datatype": "FP32", "shape": [1]},
    {"name": "exact", "datatype": "FP64", "shape": [1], "range": [-1.5, 1.5]},
    {"name": "half", "datatype": "FP16", "shape": [1]},
    {"name": "small", "datatype": "UINT8", "shape": [1], "range": [0.5, 200.5]},
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
# A model no reader judges: its inputs are not batched.
UNBATCHED = parse_model_config(
    {
        "name": "u",
        "runtime": "python",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    },
    source="test",
)
SPECS = {spec["name"]: spec for spec in INPUTS}

GOOD: dict[str, list[Any]] = {
    "age": [30],
    "spend": [0.05],
    "free": [-1e10],
    "exact": [1.25],
    "half": [2.5],
    "small": [200],
    "plan": [b"b"],
    "text": [b"hello"],
    "flag": [True],
    "vec": [1, 2.5, -3],
    "tokens": [5, 6, 7, 8],
}


def raw(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in values)
    return np.array(values, dtype=DATATYPES[datatype]).tobytes()


def same(found: tuple[list[Tensor], Checked], general: tuple[list[Tensor], Checked]) -> None:
    (tensors, checked), (expected_tensors, expected) = found, general
    assert (checked.rows, checked.group) == (expected.rows, expected.group)
    assert list(checked.arrays) == list(expected.arrays)
    for name, array in expected.arrays.items():
        same_array(checked.arrays[name], array)
    assert [t.name for t in tensors] == [t.name for t in expected_tensors]
    for a, b in zip(tensors, expected_tensors, strict=True):
        assert (a.datatype, a.parameters) == (b.datatype, b.parameters)
        same_array(a.data, b.data)


def same_array(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert a.tolist() == b.tolist() or (a.dtype.kind == "f" and np.array_equal(a, b, True))


F32_SPEND = float(np.nextafter(np.float32(0.1), np.float32(0)))  # (the last FP32 <= 0.1)
F32_WIDE = float(np.float32(1e30))
VALID: dict[str, st.SearchStrategy[Any]] = {
    "age": st.integers(1, 120),
    "spend": st.floats(0, F32_SPEND, width=32),
    "free": st.floats(-F32_WIDE, F32_WIDE, width=32),
    "exact": st.floats(-1.5, 1.5),
    "half": st.floats(-65504, 65504, width=16),
    "small": st.integers(1, 200),
    "plan": st.sampled_from([b"a", b"b"]),
    "text": st.binary(max_size=5),
    "flag": st.booleans(),
    "vec": st.floats(-F32_WIDE, F32_WIDE, width=32),
    "tokens": st.integers(0, 999),
}
# Values on and past each input's bounds, and values no rule takes.
EDGES: dict[str, list[Any]] = {
    "age": [0, 1, 120, 121, -(2**63), 2**63 - 1],
    "spend": [0.1, 0.10000000149011612, -0.0, -1e-45, math.nan, math.inf],
    "free": [math.nan, math.inf, -math.inf, 3.4028235e38],
    "exact": [1.5, 1.5000000000000002, -1.5, math.nan, -math.inf],
    "half": [65504.0, math.nan, math.inf],
    "small": [0, 1, 200, 201, 255],
    "plan": [b"c", b"A", b""],
    "text": [b"", b"\x00\xff"],
    "flag": [False, True],
    "vec": [math.nan, math.inf],
    "tokens": [-1, 0, 999, 1000],
}
