"""Tensors as the Open Inference Protocol names them, and their numpy form.

A tensor on the wire is a name, an OIP datatype, a shape and its data, either as JSON (a flat or
nested list) or as raw little-endian bytes (the binary tensor extension). In the process it is a
numpy array: numbers and BOOL as native dtypes, BYTES as an object array of ``bytes`` or ``str``
(JSON gives ``str``, binary gives ``bytes``; runtimes normalise what they need).
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.errors import InvalidInput

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

_FROM_NUMPY: dict[str, str] = {
    "b": "BOOL",
    "i1": "INT8",
    "i2": "INT16",
    "i4": "INT32",
    "i8": "INT64",
    "u1": "UINT8",
    "u2": "UINT16",
    "u4": "UINT32",
    "u8": "UINT64",
    "f2": "FP16",
    "f4": "FP32",
    "f8": "FP64",
}

# Which numpy kinds of decoded JSON data a datatype accepts without losing meaning.
_ACCEPTS_KINDS: dict[str, str] = {"b": "bi", "i": "biu", "u": "biu", "f": "biuf"}


@dataclass(slots=True)
class Tensor:
    """A named array with its OIP datatype; ``parameters`` are the tensor's OIP parameters."""

    name: str
    datatype: str
    data: np.ndarray[Any, Any]
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> list[int]:
        return list(self.data.shape)


def datatype_of(array: np.ndarray[Any, Any]) -> str:
    """The OIP datatype of a numpy array (object and string arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    key = "b" if array.dtype.kind == "b" else f"{array.dtype.kind}{array.dtype.itemsize}"
    try:
        return _FROM_NUMPY[key]
    except KeyError:
        raise InvalidInput(f"numpy dtype {array.dtype} has no OIP datatype") from None


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    try:
        return DATATYPES[datatype]
    except KeyError:
        known = ", ".join(DATATYPES)
        raise InvalidInput(f"unknown datatype {datatype!r} (known: {known})") from None


# The most dimensions a tensor may have (numpy 1 allows 32; no model has nearly as many), and
# the most elements its non-zero dimensions may multiply to: numpy refuses to make an array
# beyond that even when another dimension is 0, so that it would hold nothing.
MAX_DIMS = 32
_MAX_EXTENT = 2**58


def check_shape(name: str, shape: Sequence[int]) -> int:
    """The number of elements of ``shape``, a shape a tensor may have."""
    # Shapes arrive as lists of ints (the decoder checks the type); sign and size are left.
    if not shape:
        return 1
    least = min(shape)
    if least < 0:
        raise InvalidInput(f"tensor {name!r}: shape {list(shape)} must hold integers >= 0")
    if len(shape) > MAX_DIMS:
        raise InvalidInput(
            f"tensor {name!r}: shape has {len(shape)} dimensions, more than {MAX_DIMS}"
        )
    extent = math.prod(shape) if least else math.prod(d for d in shape if d)
    if extent > _MAX_EXTENT:
        raise InvalidInput(
            f"tensor {name!r}: shape {list(shape)} is too large: its dimensions may multiply "
            f"to at most 2**58 elements, and its data must fit the request body limit"
        )
    return extent if least else 0


# --- JSON -----------------------------------------------------------------------------------


def from_json(name: str, datatype: str, shape: Sequence[int], data: Any) -> np.ndarray[Any, Any]:
    """Decode a tensor's JSON ``data`` (flat or nested, row-major) into an array of ``shape``."""
    dtype = numpy_dtype(datatype)
    if type(data) is list and _counts(shape, len(data)):
        # Most tensors: a flat list of a few plain values, of a shape of one dimension (or a
        # row of them: [rows, n]) that counts it, so the shape is sound too. The array is made
        # in one call.
        array = _small_numbers(dtype, data) if dtype.kind != "O" else _small_texts(data)
        if array is not None:
            return array if len(shape) == 1 else array.reshape(shape)
    count = check_shape(name, shape)
    if data is None:
        raise InvalidInput(f"tensor {name!r}: 'data' is missing")
    if not isinstance(data, list):
        data = [data]
    array = _small_numbers(dtype, data)
    if array is None:
        if datatype == "BYTES":
            array = _bytes_array(name, data)
        else:
            array = _number_array(name, datatype, dtype, data)
    if array.size != count:
        raise InvalidInput(
            f"tensor {name!r}: shape {list(shape)} needs {count} elements, data has {array.size}"
        )
    return array.reshape(shape)


def _counts(shape: Sequence[int], size: int) -> bool:
    """Whether ``shape`` has one dimension, or two of at least one each, that hold ``size``
    values. (An empty tensor of two dimensions takes the general path: one of them may be 0
    and the other past what numpy can shape, which `check_shape` refuses.)"""
    if len(shape) == 1:
        return shape[0] == size
    if len(shape) == 2:
        rows, columns = shape
        return rows > 0 and columns > 0 and rows * columns == size
    return False


# A short flat list of plain numbers (most requests' tensors: a field or a few per row) is
# converted in one call, to the same values the general path gives; anything else takes the
# general path, which also says what is wrong.
_SMALL = 64
_EXACT_IN_DOUBLE = 2**53


def _small_numbers(dtype: np.dtype[Any], data: list[Any]) -> np.ndarray[Any, Any] | None:
    if len(data) > _SMALL:
        return None
    kind = dtype.kind
    if kind in "iu":
        for value in data:
            if type(value) is not int:  # bools and floats: the general path
                return None
        try:
            return np.array(data, dtype=dtype)
        except OverflowError:  # out of the type's range: the general path says so
            return None
    if kind == "f":
        for value in data:
            kind_of = type(value)
            if kind_of is int:
                # An int reaches a float type through a double on the general path too: exact
                # up to 2**53, past that the two roundings might differ.
                if not -_EXACT_IN_DOUBLE <= value <= _EXACT_IN_DOUBLE:
                    return None
            elif kind_of is not float:
                return None
        try:
            with np.errstate(over="raise"):
                return np.array(data, dtype=dtype)
        except FloatingPointError:  # past the type's range: the general path says so
            return None
    return None


def _small_texts(data: list[Any]) -> np.ndarray[Any, Any] | None:
    """A short flat list of strings (or bytes) as a BYTES array; None for anything else."""
    if len(data) > _SMALL:
        return None
    for value in data:
        kind_of = type(value)
        if kind_of is not str and kind_of is not bytes:
            return None
    return _object_array(data)


def _bytes_array(name: str, data: list[Any]) -> np.ndarray[Any, Any]:
    flat = _flatten(name, data)
    for item in flat:
        if not isinstance(item, str | bytes):
            raise InvalidInput(
                f"tensor {name!r}: BYTES data must be strings, got {type(item).__name__}"
            )
    return _object_array(flat)


def _object_array(values: list[Any]) -> np.ndarray[Any, Any]:
    """A flat list of strings or bytes as a one-dimensional object array, the items as they are
    (np.array would make a fixed-width string array of them)."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _number_array(
    name: str, datatype: str, dtype: np.dtype[Any], data: list[Any]
) -> np.ndarray[Any, Any]:
    try:
        array = np.asarray(data)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"tensor {name!r}: data is not a regular nested list") from exc
    accepts = _ACCEPTS_KINDS[dtype.kind]
    if array.size and array.dtype.kind not in accepts:
        found = "non-numeric values" if array.dtype.kind in "OUS" else f"{array.dtype} values"
        raise InvalidInput(f"tensor {name!r}: datatype {datatype} cannot hold {found}")
    # (A signed 64-bit type is narrower too for values numpy read as unsigned, 2**63 and up.)
    narrower = dtype.itemsize < 8 or dtype.kind == "u" or array.dtype.kind == "u"
    if narrower and dtype.kind in "iu" and array.size and array.dtype.kind in "iu":
        # astype wraps silently (300 -> 44 as UINT8): refuse values the type cannot hold.
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidInput(f"tensor {name!r}: data does not fit datatype {datatype}")
    try:
        # A finite value past a float type's range (1e10 as FP16) would become infinity.
        with np.errstate(over="raise"):
            return array.astype(dtype, copy=False)
    except (ValueError, TypeError, OverflowError, FloatingPointError) as exc:
        raise InvalidInput(f"tensor {name!r}: data does not fit datatype {datatype}") from exc


def _flatten(name: str, data: list[Any]) -> list[Any]:
    if not any(isinstance(item, list) for item in data):
        return data
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
        if len(stack) > 64:
            raise InvalidInput(f"tensor {name!r}: data is nested too deeply")
    return flat


def to_json_data(array: np.ndarray[Any, Any]) -> Any:
    """The flat row-major ``data`` list of an output tensor, ready for orjson."""
    if array.dtype.kind == "O" or array.dtype.kind in "SU":
        return [_text(item) for item in array.reshape(-1).tolist()]
    if array.dtype.kind == "f" and array.dtype.itemsize == 2:
        return array.astype(np.float32).reshape(-1)
    return np.ascontiguousarray(array).reshape(-1)


def _text(item: Any) -> str:
    if isinstance(item, bytes):
        return item.decode("utf-8", errors="replace")
    return str(item)


# --- binary tensor extension ----------------------------------------------------------------


def from_binary(name: str, datatype: str, shape: Sequence[int], buffer: bytes | memoryview) -> Any:
    """Decode raw little-endian bytes (BYTES: 4-byte length-prefixed items) into ``shape``."""
    dtype = numpy_dtype(datatype)
    count = check_shape(name, shape)
    if datatype == "BYTES":
        items = split_bytes(name, buffer)
        if len(items) != count:
            raise InvalidInput(
                f"tensor {name!r}: shape {list(shape)} needs {count} elements, "
                f"binary data has {len(items)}"
            )
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(shape)
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise InvalidInput(
            f"tensor {name!r}: shape {list(shape)} of {datatype} needs {expected} bytes, "
            f"got {len(buffer)}"
        )
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def split_bytes(name: str, buffer: bytes | memoryview) -> list[bytes]:
    view = memoryview(buffer)
    items: list[bytes] = []
    offset, end = 0, len(view)
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput(f"tensor {name!r}: BYTES data ends inside a length prefix")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidInput(f"tensor {name!r}: BYTES item runs past the end of the data")
        items.append(bytes(view[offset : offset + length]))
        offset += length
    return items


def to_binary(array: np.ndarray[Any, Any]) -> bytes:
    """Raw bytes of an array for the binary extension (BYTES items are length-prefixed)."""
    if array.dtype.kind in "OSU":
        parts: list[bytes] = []
        for item in array.reshape(-1).tolist():
            raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
            parts.append(struct.pack("<I", len(raw)))
            parts.append(raw)
        return b"".join(parts)
    if array.dtype.byteorder in _LITTLE:  # (tobytes: C order whatever the memory layout)
        return array.tobytes()
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


# The byte orders numpy names that are little-endian ("|": one byte; "=": the machine's).
_LITTLE = ("<", "|", "=") if sys.byteorder == "little" else ("<", "|")
