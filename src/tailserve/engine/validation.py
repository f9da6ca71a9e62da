"""Check a request's tensors against the model's declared inputs before anything is queued.

Everything a client can get wrong is caught here with a message naming the tensor: a missing or
unknown input, a datatype or shape that differs from model.yaml, a batch over the model's limit,
rows that disagree between inputs, and values outside a declared range or set.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.errors import InvalidInput
from tailserve.repository.config import ModelConfig, TensorSpec
from tailserve.tensors import Tensor

Arrays = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True, slots=True)
class Checked:
    arrays: Arrays
    rows: int
    # Requests batch together only when every input has the same per-row shape.
    group: Hashable


def check_inputs(config: ModelConfig, tensors: Sequence[Tensor]) -> Checked:
    given: dict[str, Tensor] = {}
    for item in tensors:
        if item.name in given:
            raise InvalidInput(f"input {item.name!r} is given twice")
        given[item.name] = item
    arrays: Arrays = {}
    rows = 1
    row_shapes: list[tuple[int, ...]] = []
    for spec in config.inputs:
        tensor = given.pop(spec.name, None)
        if tensor is None:
            if spec.optional:
                continue
            raise InvalidInput(f"model {config.name!r}: input {spec.name!r} is missing")
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"input {spec.name!r}: datatype {tensor.datatype} does not match "
                f"the model's {spec.datatype}"
            )
        array = _shaped(config, spec, tensor.data)
        if config.batched:
            if arrays and len(array) != rows:
                raise InvalidInput(
                    f"input {spec.name!r} has {len(array)} rows, other inputs have {rows}"
                )
            rows = len(array)
        _check_values(spec, array)
        arrays[spec.name] = array
        row_shapes.append(array.shape[1:] if config.batched else array.shape)
    if given:
        names = ", ".join(repr(name) for name in given)
        raise InvalidInput(f"model {config.name!r} has no input named {names}")
    if config.batched and not 1 <= rows <= config.max_batch_size:
        raise InvalidInput(
            f"model {config.name!r}: a request holds 1 to {config.max_batch_size} rows, got {rows}"
        )
    return Checked(arrays, rows, (tuple(arrays), tuple(row_shapes)))


def _shaped(config: ModelConfig, spec: TensorSpec, array: np.ndarray[Any, Any]) -> Any:
    expected = config.full_shape(spec)
    shape = array.shape
    # Per-row shape [1] may come as a flat [N] column: KServe clients and most users send that.
    if config.batched and spec.shape == [1] and len(shape) == 1:
        array = array.reshape(-1, 1)
        shape = array.shape
    fits = len(shape) == len(expected) and all(
        want == -1 or want == got for want, got in zip(expected, shape, strict=True)
    )
    if not fits:
        raise InvalidInput(
            f"input {spec.name!r}: shape {list(shape)} does not match the model's {expected}"
        )
    return array


def _check_values(spec: TensorSpec, array: np.ndarray[Any, Any]) -> None:
    if spec.range is not None and array.size:
        low, high = spec.range
        inside = (array >= low) & (array <= high)
        if not inside.all():
            bad = array[~inside].reshape(-1)[0]
            raise InvalidInput(
                f"input {spec.name!r}: value {bad.item()!r} is outside the allowed range "
                f"[{_num(low)}, {_num(high)}]"
            )
    if spec.values is not None:
        allowed = _allowed(spec)
        for item in array.reshape(-1).tolist():
            if item not in allowed:
                shown = item.decode("utf-8", "replace") if isinstance(item, bytes) else item
                choices = ", ".join(spec.values)
                raise InvalidInput(
                    f"input {spec.name!r}: unknown value {shown!r} (allowed: {choices})"
                )


_ALLOWED_CACHE: dict[int, frozenset[Any]] = {}


def _allowed(spec: TensorSpec) -> frozenset[Any]:
    # Specs are frozen and live as long as their config; keyed by id to avoid rebuilding per call.
    key = id(spec)
    allowed = _ALLOWED_CACHE.get(key)
    if allowed is None:
        values = spec.values or []
        allowed = frozenset([*values, *(v.encode() for v in values)])
        _ALLOWED_CACHE[key] = allowed
    return allowed


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
