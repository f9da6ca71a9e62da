"""A model's own decoder of OIP JSON bodies: decoding and checking in one pass, in C.

The general decoder (`oip.decode_request`) reads any body into tensors, and the data plane then
checks them against the model (`engine.validation.InputPlan`): some forty Python calls a
tensor. This one is built once per model version from its declared inputs, as a msgspec type:
each input an object tagged by its name, its datatype fixed, its values typed and held to the
datatype's bounds, the declared range or the allowed values. msgspec checks all of that while it
decodes; what is left in Python is the shape (a comparison a tensor) and one array a tensor.

It takes only bodies it can judge exactly as the general path would (JSON, no binary data,
flat data lists, every input well formed and in bounds) and hands back the request with its
inputs already checked. Anything else, an error above all, returns None and goes the general
way, which says what is wrong in the same words as ever. So a request is answered alike
whichever path reads it; this one is only faster.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

import msgspec
import numpy as np

from tailserve.engine.messages import InferRequest
from tailserve.engine.validation import Checked, InputPlan
from tailserve.errors import InvalidInput
from tailserve.modelconfig import ModelConfig, TensorSpec
from tailserve.protocols.http.json_layouts import JsonLayouts
from tailserve.protocols.http.oip import Output, request_of
from tailserve.tensors import DATATYPES, Tensor

R = TypeVar("R")
# Floats from JSON integers past 2**53 may round twice on the general path: past it, the
# general path decides.
_EXACT = float(2**53)


class _Shaped:
    """What a tensor's shape must be, from its rule."""

    __slots__ = ("column", "dtype", "optional", "per_row", "per_row_count", "texts")

    def __init__(self, spec: TensorSpec, config: ModelConfig) -> None:
        self.dtype = DATATYPES[spec.datatype]
        self.texts = spec.datatype == "BYTES"
        self.optional = spec.optional
        self.per_row = list(spec.shape)
        fixed = -1 not in spec.shape
        self.per_row_count = math.prod(spec.shape) if fixed else None
        self.column = config.batched and spec.shape == [1]

    def rows_of(self, shape: list[int], count: int) -> int:
        """The rows of a tensor of ``shape`` holding ``count`` values; -1: not for this path."""
        if len(shape) == 1:
            rows = shape[0]
            return rows if self.column and rows == count else -1
        rows = shape[0]
        if self.per_row_count is not None:
            if shape[1:] != self.per_row or rows * self.per_row_count != count:
                return -1
            return rows
        if len(shape) != len(self.per_row) + 1:
            return -1
        for want, got in zip(self.per_row, shape[1:], strict=True):
            if got < 1 or (want != -1 and want != got):
                return -1
        return rows if math.prod(shape) == count else -1


class TypedDecoder:
    """One model version's decoder (`decoder_for`)."""

    def __init__(self, config: ModelConfig, plan: InputPlan) -> None:
        self.plan = plan
        self.max_rows = config.max_batch_size
        self._shapes = {spec.name: _Shaped(spec, config) for spec in config.inputs}
        self._order = [spec.name for spec in config.inputs]
        tagged = tuple(_input_type(spec) for spec in config.inputs)
        self._names = {kind: spec.name for kind, spec in zip(tagged, config.inputs, strict=True)}
        request = msgspec.defstruct(
            "TypedRequest",
            [
                ("inputs", list[Union[tagged]]),  # type: ignore[valid-type]  # noqa: UP007
                ("id", Union[str, None], None),  # noqa: UP007
                ("outputs", Union[list[Output], None], None),  # noqa: UP007
                ("parameters", Union[dict[str, Any], None], None),  # noqa: UP007
            ],
        )
        self._decode: Callable[[bytes], Any] = msgspec.json.Decoder(request).decode
        dtypes = {name: shaped.dtype for name, shaped in self._shapes.items()}
        self.layouts = JsonLayouts(self._names, dtypes)

    def decode(self, model: str, version: str | None, body: bytes) -> InferRequest | None:
        """The request, its inputs checked; None: not one this decoder takes."""
        try:
            raw = self._decode(body)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            return None
        read = self.layouts.read(raw.inputs)
        if read is not None:
            try:
                request = request_of(model, version, raw, read[0])
            except InvalidInput:
                return None
            request.checked = (self.plan, read[1])
            return request
        given: dict[str, Any] = {}
        names = self._names
        for item in raw.inputs:
            name = names[type(item)]
            if name in given:
                return None
            given[name] = item
        tensors: list[Tensor] = []
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        row_shapes: list[tuple[int, ...]] = []
        rows = -1
        shapes = self._shapes
        for name in self._order:
            item = given.get(name)
            rule = shapes[name]
            if item is None:
                if not rule.optional:
                    return None  # (the general path names the missing input)
                continue
            parameters = item.parameters
            if parameters and "binary_data_size" in parameters:
                return None
            data = item.data
            count = len(data)
            shape = item.shape
            found = rule.rows_of(shape, count)
            if found < 1 or (rows != -1 and found != rows):
                return None
            rows = found
            array: np.ndarray[Any, Any]
            if rule.texts:
                array = np.empty(count, dtype=object)
                array[:] = data
            else:
                array = np.array(data, dtype=rule.dtype)
            if len(shape) > 1:
                array = array.reshape(shape)
            tensors.append(Tensor(name, item.datatype, array, parameters or {}))
            if array.ndim == 1:  # a column sent flat: [N] for [N, 1]
                array = array.reshape(-1, 1)
            arrays[name] = array
            row_shapes.append(array.shape[1:])
        if not 1 <= rows <= self.max_rows:
            return None
        try:
            request = request_of(model, version, raw, tensors)
        except InvalidInput:
            return None
        checked = Checked(arrays, rows, (tuple(arrays), tuple(row_shapes)))
        request.checked = (self.plan, checked)
        self.layouts.learn(raw.inputs, tensors, checked)
        return request


def takes(config: ModelConfig) -> bool:
    """Whether a model's inputs can be judged by a typed decoder: a batched model whose inputs
    the client sends (no feature store), BOOL ones with no range or set of values."""
    if not config.batched or config.features is not None:
        return False
    for spec in config.inputs:
        if spec.datatype == "BOOL" and (spec.range is not None or spec.values is not None):
            return False
    return True


def _input_type(spec: TensorSpec) -> type:
    element = _element(spec)
    return msgspec.defstruct(
        f"Input_{spec.name}",
        [
            ("datatype", Literal[spec.datatype]),
            ("shape", list[int]),
            ("data", element),
            ("parameters", Union[dict[str, Any], None], None),  # noqa: UP007
        ],
        tag_field="name",
        tag=spec.name,
    )


def _element(spec: TensorSpec) -> Any:
    """The type of a tensor's ``data``: a flat list of values its datatype and rule allow."""
    dtype = DATATYPES[spec.datatype]
    if dtype.kind == "O":
        if spec.values is not None:
            return list[Literal[tuple(spec.values)]]  # type: ignore[misc]
        return list[str]
    if dtype.kind == "b":
        return list[bool]
    low, high = spec.range if spec.range is not None else (None, None)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # (msgspec bounds an int within int64's: UINT64's top half goes the general way.)
        least, most = int(info.min), min(int(info.max), 2**63 - 1)
        if low is not None and high is not None:
            least, most = max(least, math.ceil(low)), min(most, math.floor(high))
        return list[Annotated[int, msgspec.Meta(ge=least, le=most)]]
    top = min(float(np.finfo(dtype).max), _EXACT)
    floor, ceiling = -top, top
    if low is not None and high is not None:
        # The general path holds the value as narrowed to the datatype to the range: the
        # bounds are the widest values sent that narrow to within it.
        floor = max(floor, _narrowed_bound(dtype, float(low), -1))
        ceiling = min(ceiling, _narrowed_bound(dtype, float(high), 1))
    return list[Annotated[float, msgspec.Meta(ge=floor, le=ceiling)]]


def _narrowed_bound(dtype: np.dtype[Any], bound: float, side: int) -> float:
    """The farthest double past ``bound`` (``side`` 1: above it, -1: below) that still
    narrows to a value of ``dtype`` within it (round to nearest, ties to even)."""
    if dtype.itemsize == 8:
        return bound
    kind = dtype.type
    top = float(np.finfo(dtype).max)
    if abs(bound) >= top:  # at or past the type's own end: the caller bounds by that
        return bound
    inside = kind(bound)
    if float(inside) * side > bound * side:  # rounded past the bound: step back in
        inside = np.nextafter(inside, kind(-side * np.inf))
    outside = np.nextafter(inside, kind(side * np.inf))
    middle = (float(inside) + float(outside)) / 2  # (exact: two more bits than the type)
    if kind(middle) == inside:
        return middle
    return float(np.nextafter(middle, -side * np.inf))


class PerPlan(Generic[R]):
    """A reader of a model version's requests, made by ``make`` on first use and kept while
    the version's input plan lives; None for a model whose inputs it cannot judge (`takes`)."""

    def __init__(self, make: Callable[[ModelConfig, InputPlan], R]) -> None:
        self._make = make
        self._made: weakref.WeakKeyDictionary[InputPlan, R | None] = weakref.WeakKeyDictionary()

    def __call__(self, config: ModelConfig, plan: InputPlan) -> R | None:
        try:
            return self._made[plan]
        except KeyError:
            pass
        made = self._make(config, plan) if takes(config) else None
        self._made[plan] = made
        return made


# The typed decoder of a model version.
decoder_for = PerPlan(TypedDecoder)
