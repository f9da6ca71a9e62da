"""Check a request's tensors against the model's declared inputs before anything is queued.

Everything a client can get wrong is caught here with a message naming the tensor: a missing or
unknown input, a datatype or shape that differs from model.yaml, a batch over the model's limit,
rows that disagree between inputs, and values outside a declared range or set.

An `InputPlan` is built once per model version, so the request path only compares.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailserve.errors import InvalidInput, shown
from tailserve.modelconfig import ModelConfig, TensorSpec
from tailserve.tensors import Tensor

Arrays = dict[str, np.ndarray[Any, Any]]

# Below this many values, plain Python comparisons beat numpy's per-call overhead.
_SMALL = 64


@dataclass(frozen=True, slots=True)
class Checked:
    arrays: Arrays
    rows: int
    # Requests batch together only when every input has the same per-row shape.
    group: Hashable


@dataclass(frozen=True, slots=True)
class _InputRule:
    name: str
    datatype: str
    expected: tuple[int, ...]  # full shape, -1 for "any"
    exact_rows: tuple[int, ...] | None  # the per-row shape when it has no -1 (fast compare)
    column: bool  # per-row shape [1]: a flat [N] column is accepted too
    optional: bool
    low: float | None
    high: float | None
    allowed: frozenset[Any] | None
    allowed_text: str
    checks_values: bool  # a range or a set of values to check


class InputPlan:
    def __init__(self, config: ModelConfig) -> None:
        self.model = config.name
        self.batched = config.batched
        self.max_rows = config.max_batch_size
        self.rules = [_rule(config, spec) for spec in config.inputs]
        self._names = {rule.name for rule in self.rules}

    def check(self, tensors: Sequence[Tensor], *, max_rows: int | None = None) -> Checked:
        """The inputs checked and shaped; ``max_rows``: the most rows (default the model's
        max_batch_size; a job's request may hold more, run in pieces)."""
        most = self.max_rows if max_rows is None else max_rows
        given: dict[str, Tensor] = {}
        for item in tensors:
            if item.name in given:
                raise InvalidInput(f"input {item.name!r} is given twice")
            if item.name not in self._names:
                raise InvalidInput(f"model {self.model!r} has no input named {item.name!r}")
            given[item.name] = item
        arrays: Arrays = {}
        rows = -1
        row_shapes = []
        for rule in self.rules:
            tensor = given.get(rule.name)
            if tensor is None:
                if rule.optional:
                    continue
                raise InvalidInput(f"model {self.model!r}: input {rule.name!r} is missing")
            if tensor.datatype != rule.datatype:
                raise InvalidInput(
                    f"input {rule.name!r}: datatype {tensor.datatype} does not match "
                    f"the model's {rule.datatype}"
                )
            given_array = tensor.data
            array = _shaped(rule, given_array)
            if self.batched:
                if rows == -1:
                    rows = len(array)
                elif len(array) != rows:
                    raise InvalidInput(
                        f"input {rule.name!r} has {len(array)} rows, other inputs have {rows}"
                    )
                row_shapes.append(array.shape[1:])
            else:
                row_shapes.append(array.shape)
            if rule.checks_values:
                _check_values(rule, given_array)
            arrays[rule.name] = array
        if self.batched and not 1 <= rows <= most:
            raise InvalidInput(
                f"model {self.model!r}: a request holds 1 to {most} rows, got {rows}"
            )
        return Checked(arrays, max(rows, 1), (tuple(arrays), tuple(row_shapes)))


def check_inputs(config: ModelConfig, tensors: Sequence[Tensor]) -> Checked:
    """One-off check (tests, tools); servers keep an `InputPlan` per model version."""
    return InputPlan(config).check(tensors)


def _rule(config: ModelConfig, spec: TensorSpec) -> _InputRule:
    allowed = None
    if spec.values is not None:
        allowed = frozenset([*spec.values, *(v.encode() for v in spec.values)])
    low, high = spec.range if spec.range is not None else (None, None)
    return _InputRule(
        name=spec.name,
        datatype=spec.datatype,
        expected=tuple(config.full_shape(spec)),
        exact_rows=None if -1 in spec.shape else tuple(spec.shape),
        column=config.batched and spec.shape == [1],
        optional=spec.optional,
        low=low,
        high=high,
        allowed=allowed,
        allowed_text=", ".join(spec.values or []),
        checks_values=(low is not None and high is not None) or allowed is not None,
    )


def _shaped(rule: _InputRule, array: np.ndarray[Any, Any]) -> Any:
    shape = array.shape
    if rule.column and len(shape) == 1:
        array = array.reshape(-1, 1)
        shape = array.shape
    expected = rule.expected
    rows_shape = shape[1:] if len(expected) > len(rule.exact_rows or ()) else shape
    if len(shape) == len(expected) and rows_shape == rule.exact_rows:
        return array
    if len(shape) != len(expected) or any(
        want != got and want != -1 for want, got in zip(expected, shape, strict=True)
    ):
        raise InvalidInput(
            f"input {rule.name!r}: shape {list(shape)} does not match the model's {list(expected)}"
        )
    return array


def _check_values(rule: _InputRule, array: np.ndarray[Any, Any]) -> None:
    size = array.size
    small = size <= _SMALL
    values = array.ravel().tolist() if small or rule.allowed is not None else []
    if rule.low is not None and rule.high is not None and size:
        low, high = rule.low, rule.high
        if small:
            # `low <= v <= high` is False for NaN, so NaN is refused as out of range too.
            for value in values:
                if not low <= value <= high:
                    _out_of_range(rule, value)
        else:
            inside = (array >= low) & (array <= high)
            if not inside.all():
                _out_of_range(rule, array[~inside].reshape(-1)[0].item())
    if rule.allowed is not None:
        for item in values:
            if item not in rule.allowed:
                raise InvalidInput(
                    f"input {rule.name!r}: unknown value {shown(item)} "
                    f"(allowed: {rule.allowed_text})"
                )


def _out_of_range(rule: _InputRule, value: Any) -> None:
    raise InvalidInput(
        f"input {rule.name!r}: value {value!r} is outside the allowed range "
        f"[{_num(rule.low)}, {_num(rule.high)}]"
    )


def _num(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else str(value)
