"""Requests read by a layout met before: raw input buffers read in one pass.

A client sends the same inputs (names, datatypes, shapes, parameters) request after request,
only the raw bytes of each input differing: over gRPC (`raw_input_contents`) and over HTTP's
binary extension (the buffers after the JSON header). Once such a request has been read and
checked the general way, its layout (`Layout`) reads a later one of the same layout in one pass:
each numeric datatype's buffers joined into one array and held to their ranges at once, the
inputs cut from it as views, BYTES items split and held to their allowed values, the checked
arrays handed on as the model's input plan would make them.

A layout reads only what it can judge exactly as the general way would: a buffer of another
length, a value out of range or not a number where a range applies, a BYTES item not allowed,
go the general way, which says what is wrong in the same words as ever. The protocols decide
which requests share a layout (`grpc.layouts`, `http.binary_layouts`) and keep a layout only
once a recent request repeats it (`Recent`): building one costs more than reading a request.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tailserve.engine.validation import Checked
from tailserve.errors import InvalidInput
from tailserve.modelconfig import TensorSpec
from tailserve.tensors import DATATYPES, Tensor, split_bytes

# The layouts a model version keeps: the newest first.
KEPT = 4
# The layouts of recent requests read the general way, remembered by their signature: one is
# kept only when a request repeats one of these (a model whose shapes vary call by call, as
# token sequences do, would otherwise pay for a layout a call).
SEEN = 8
_INT64 = np.iinfo(np.int64)
_LENGTH = struct.Struct("<I")
# A group of at most this many values is held to its ranges value by value.
_FEW = 32


class _Group:
    """The numeric inputs of one datatype in a layout: their buffers are read joined."""

    __slots__ = ("bounds", "dtype", "high", "lengths", "low", "positions", "stacked")

    def __init__(self, dtype: np.dtype[Any], positions: list[int], lengths: list[int]) -> None:
        self.dtype = dtype
        self.positions = positions
        self.lengths = lengths
        self.low: np.ndarray[Any, Any] | None = None
        self.high: np.ndarray[Any, Any] | None = None
        # A few values' ranges as lists, compared one by one in Python (cheaper than numpy's
        # three passes for a handful of values).
        self.bounds: tuple[list[Any], list[Any]] | None = None
        # Where its inputs share one shape: the joined array's shape, an input a row (each
        # input is then one index of it).
        self.stacked: tuple[int, ...] | None = None


class _Piece:
    """One input of a layout, in the request's order."""

    __slots__ = ("allowed", "count", "datatype", "group", "name", "parameters", "shape", "start")

    def __init__(self, tensor: Tensor) -> None:
        self.name = tensor.name
        self.datatype = tensor.datatype
        self.shape: tuple[int, ...] = tuple(tensor.data.shape)
        self.count: int = tensor.data.size
        # (each request's tensor gets a copy of these, as the general way gives it its own)
        self.parameters = dict(tensor.parameters)
        self.group = -1  # (the index of its `_Group`; -1: BYTES, read on its own)
        self.start = 0  # (its first value in its group's array; its row, where stacked)
        self.allowed: frozenset[Any] | None = None


class Layout:
    """What a kept request's inputs were, and how to read another of the same."""

    __slots__ = ("group", "groups", "order", "pieces", "rows")

    def __init__(self, checked: Checked) -> None:
        self.rows = checked.rows
        self.group = checked.group
        self.pieces: list[_Piece] = []
        self.groups: list[_Group] = []
        # (each checked input's name, its place in the request, its shape if reshaped)
        self.order: list[tuple[str, int, tuple[int, ...] | None]] = []

    def read(self, raw: Sequence[bytes]) -> tuple[list[Tensor], Checked] | None:
        """The inputs of a request of this layout and their checked arrays; None: not one
        this layout judges (the general way decides)."""
        if len(raw) != len(self.pieces):
            return None
        values: list[Any] = []
        for group in self.groups:
            parts = [raw[i] for i in group.positions]
            if list(map(len, parts)) != group.lengths:
                return None
            array = np.frombuffer(b"".join(parts), dtype=group.dtype)
            if group.bounds is not None:
                for value, least, most in zip(array.tolist(), *group.bounds, strict=True):
                    if not least <= value <= most:  # (False for NaN too)
                        return None
            elif group.low is not None and not ((array >= group.low) & (array <= group.high)).all():
                return None
            values.append(array if group.stacked is None else array.reshape(group.stacked))
        data: list[Any] = []
        for index, piece in enumerate(self.pieces):
            if piece.group >= 0:
                if self.groups[piece.group].stacked is not None:
                    data.append(values[piece.group][piece.start])
                    continue
                start = piece.start
                data.append(values[piece.group][start : start + piece.count].reshape(piece.shape))
                continue
            texts = _texts(raw[index], piece)
            if texts is None:
                return None
            data.append(texts)
        tensors = [
            Tensor(piece.name, piece.datatype, array, dict(piece.parameters))
            for piece, array in zip(self.pieces, data, strict=True)
        ]
        arrays = {
            name: data[index] if shape is None else data[index].reshape(shape)
            for name, index, shape in self.order
        }
        return tensors, Checked(arrays, self.rows, self.group)


def layout_of(
    tensors: Sequence[Tensor], checked: Checked, specs: Mapping[str, TensorSpec]
) -> Layout | None:
    """The layout of ``tensors`` (read from one request's raw buffers, in its order) as the
    input plan checked them; None where some input is not one a layout reads."""
    layout = Layout(checked)
    by_dtype: dict[np.dtype[Any], _Group] = {}
    for index, tensor in enumerate(tensors):
        spec = specs.get(tensor.name)
        dtype = DATATYPES.get(tensor.datatype)
        if spec is None or dtype is None or tensor.name not in checked.arrays:
            return None
        piece = _Piece(tensor)
        if dtype.kind == "O":
            if spec.values is not None:
                piece.allowed = frozenset(v.encode() for v in spec.values)
        elif dtype.kind in "biuf" and dtype != np.uint64:
            group = by_dtype.get(dtype)
            if group is None:
                group = by_dtype[dtype] = _Group(dtype, [], [])
                layout.groups.append(group)
            piece.group = layout.groups.index(group)
            piece.start = sum(layout.pieces[i].count for i in group.positions)
            group.positions.append(index)
            group.lengths.append(piece.count * dtype.itemsize)
        else:
            return None
        layout.pieces.append(piece)
    for group in layout.groups:
        _bounds(group, [specs[layout.pieces[i].name] for i in group.positions], layout)
        shapes = {layout.pieces[i].shape for i in group.positions}
        if len(shapes) == 1:
            group.stacked = (len(group.positions), *shapes.pop())
            for row, position in enumerate(group.positions):
                layout.pieces[position].start = row
    positions = {piece.name: index for index, piece in enumerate(layout.pieces)}
    for name, array in checked.arrays.items():
        piece = layout.pieces[positions[name]]
        shape = None if array.shape == piece.shape else tuple(array.shape)
        layout.order.append((name, positions[name], shape))
    return layout


class Recent:
    """The signatures of the last ``size`` requests read the general way: `repeats` says
    whether one came again (and forgets it, as it is about to be kept)."""

    def __init__(self, size: int = SEEN) -> None:
        self._size = size
        self._seen: dict[Any, None] = {}

    def repeats(self, signature: Any) -> bool:
        if signature in self._seen:
            del self._seen[signature]
            return True
        if len(self._seen) >= self._size:
            del self._seen[next(iter(self._seen))]
        self._seen[signature] = None
        return False


def _bounds(group: _Group, specs: list[TensorSpec], layout: Layout) -> None:
    """A group's ranges, a value each, as its values are held (ints exactly, floats as
    doubles: NaN is never within them, and goes the general way)."""
    if not any(spec.range is not None for spec in specs):
        return
    integral = group.dtype.kind in "iu"
    low: list[Any] = []
    high: list[Any] = []
    for spec, position in zip(specs, group.positions, strict=True):
        count = layout.pieces[position].count
        least, most = spec.range if spec.range is not None else (-math.inf, math.inf)
        if integral:
            least = _INT64.min if least == -math.inf else max(_INT64.min, math.ceil(least))
            most = _INT64.max if most == math.inf else min(_INT64.max, math.floor(most))
        low += [least] * count
        high += [most] * count
    kind = np.int64 if integral else np.float64
    group.low, group.high = np.array(low, dtype=kind), np.array(high, dtype=kind)
    if len(low) <= _FEW:
        group.bounds = (low, high)


def _texts(buffer: bytes, piece: _Piece) -> np.ndarray[Any, Any] | None:
    """A BYTES input's items as an object array of its shape; None where they are not all
    there or not all allowed."""
    if piece.count == 1 and len(buffer) >= 4 and _LENGTH.unpack_from(buffer)[0] == len(buffer) - 4:
        items = [buffer[4:]]
    else:
        try:
            items = split_bytes(piece.name, buffer)
        except InvalidInput:
            return None
        if len(items) != piece.count:
            return None
    if piece.allowed is not None and not piece.allowed.issuperset(items):
        return None
    array = np.empty(piece.count, dtype=object)
    array[:] = items
    return array.reshape(piece.shape)
