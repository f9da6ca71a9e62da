"""OIP JSON bodies of a layout met before: a model's typed decoder's inputs made a datatype at a
time.

The typed decoder (`oip_typed`) decodes and checks a body in C (msgspec), then makes an array
and a tensor an input in Python: for churn's nine inputs, some 16 of its 19 µs. A client sends
the same inputs (names, order, shapes, no parameters) body after body, only the values
differing. So once two recent bodies of a layout have been decoded that way, the layout is
kept, and a later body whose inputs come in it (their types, which name them, one lookup;
their shapes and parameters, one comparison) has each datatype's values made into one array
in one call, the inputs cut from it as views, and the checked arrays handed on as the typed
decoder makes them.

The values were held to their datatypes, ranges and allowed values by msgspec as they were
decoded, the same for either way; a layout decides only shapes, which it compares exactly: a
body it does not keep a layout for, or whose values do not fill its shapes, goes the typed
decoder's way.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tailserve.engine.validation import Checked
from tailserve.protocols.layouts import KEPT, Recent
from tailserve.tensors import Tensor

# Each input's shape and parameters, in one pass in C.
_SHAPE_AND_PARAMETERS = operator.attrgetter("shape", "parameters")
_DATA = operator.attrgetter("data")


class _Group:
    """The numeric inputs of one datatype: their values made into one array."""

    __slots__ = ("dtype", "offsets", "positions", "stacked")

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.dtype = dtype
        self.positions: list[int] = []
        # (where its inputs share one shape: the array's shape, an input a row; else each
        # input's first value and shape in the flat array)
        self.stacked: tuple[int, ...] | None = None
        self.offsets: list[tuple[int, int, tuple[int, ...]]] = []


class _Layout:
    __slots__ = ("counts", "group", "groups", "order", "rows", "signature", "texts")

    def __init__(self, signature: list[tuple[list[int], None]], checked: Checked) -> None:
        self.signature = signature
        self.counts: list[int] = []
        self.groups: list[_Group] = []
        self.texts: list[tuple[int, int, tuple[int, ...]]] = []  # (position, count, shape)
        # (each tensor in the model's order: its name, datatype, position in the body, and
        # the checked array's shape where it differs from the tensor's)
        self.order: list[tuple[str, str, int, tuple[int, ...] | None]] = []
        self.rows = checked.rows
        self.group = checked.group

    def read(self, items: Sequence[Any]) -> tuple[list[Tensor], Checked] | None:
        datas = list(map(_DATA, items))
        if list(map(len, datas)) != self.counts:
            return None
        made: list[Any] = [None] * len(datas)
        for group in self.groups:
            positions = group.positions
            if len(positions) == 1:
                values = datas[positions[0]]
            else:
                values = list(itertools.chain.from_iterable([datas[p] for p in positions]))
            array = np.array(values, dtype=group.dtype)
            if group.stacked is not None:
                array = array.reshape(group.stacked)
                for row, position in enumerate(positions):
                    made[position] = array[row]
            else:
                for position, (start, end, shape) in zip(positions, group.offsets, strict=True):
                    made[position] = array[start:end].reshape(shape)
        for position, count, shape in self.texts:
            texts = np.empty(count, dtype=object)
            texts[:] = datas[position]
            made[position] = texts.reshape(shape)
        tensors = []
        arrays = {}
        for name, datatype, position, checked_shape in self.order:
            data = made[position]
            tensors.append(Tensor(name, datatype, data, {}))
            arrays[name] = data if checked_shape is None else data.reshape(checked_shape)
        return tensors, Checked(arrays, self.rows, self.group)


class JsonLayouts:
    """One typed decoder's kept layouts. ``names``: each input's decoded type's name;
    ``dtypes``: each input's array type."""

    def __init__(self, names: dict[type, str], dtypes: dict[str, np.dtype[Any]]) -> None:
        self._names = names
        self._dtypes = dtypes
        self._kept: dict[tuple[type, ...], list[_Layout]] = {}
        self._recent = Recent()
        # (a large body is decoded on a thread of its own: learning there and on the event
        # loop at once must not race on what is remembered)
        self._learning = threading.Lock()

    def __len__(self) -> int:
        """The layouts kept."""
        return sum(map(len, self._kept.values()))

    def read(self, items: Sequence[Any]) -> tuple[list[Tensor], Checked] | None:
        """The inputs of a body of a kept layout, checked; None: the typed decoder's way."""
        layouts = self._kept.get(tuple(map(type, items)))
        if layouts is None:
            return None
        signature = list(map(_SHAPE_AND_PARAMETERS, items))
        for layout in layouts:
            if signature == layout.signature:
                return layout.read(items)
        return None

    def learn(self, items: Sequence[Any], tensors: list[Tensor], checked: Checked) -> None:
        """A body's inputs as the typed decoder made them; their layout kept once a recent
        body has had it too."""
        signature = list(map(_SHAPE_AND_PARAMETERS, items))
        if any(parameters is not None for _, parameters in signature):
            return
        types = tuple(map(type, items))
        with self._learning:
            if not self._recent.repeats((types, tuple(tuple(shape) for shape, _ in signature))):
                return
            layout = self._layout(items, signature, tensors, checked)
            kept = self._kept.setdefault(types, [])
            kept.insert(0, layout)
            del kept[KEPT:]

    def _layout(
        self,
        items: Sequence[Any],
        signature: list[tuple[list[int], None]],
        tensors: list[Tensor],
        checked: Checked,
    ) -> _Layout:
        layout = _Layout([(list(shape), None) for shape, _ in signature], checked)
        positions = {}
        by_dtype: dict[np.dtype[Any], _Group] = {}
        for position, item in enumerate(items):
            name = self._names[type(item)]
            positions[name] = position
            dtype = self._dtypes[name]
            count = len(item.data)
            shape = tuple(item.shape)
            layout.counts.append(count)
            if dtype.kind == "O":
                layout.texts.append((position, count, shape))
                continue
            group = by_dtype.get(dtype)
            if group is None:
                group = by_dtype[dtype] = _Group(dtype)
                layout.groups.append(group)
            start = group.offsets[-1][1] if group.offsets else 0
            group.positions.append(position)
            group.offsets.append((start, start + count, shape))
        for group in layout.groups:
            shapes = {shape for _, _, shape in group.offsets}
            if len(shapes) == 1:
                group.stacked = (len(group.positions), *shapes.pop())
        for tensor in tensors:
            array = checked.arrays[tensor.name]
            reshaped = None if array.shape == tensor.data.shape else tuple(array.shape)
            layout.order.append((tensor.name, tensor.datatype, positions[tensor.name], reshaped))
        return layout
