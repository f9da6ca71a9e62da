"""LightGBM: a native booster (``model.txt``) scoring a float64 matrix built from the inputs.

Inputs become columns in the order of ``inputs`` in model.yaml, each as many columns as its
per-row shape holds. A BYTES input with ``values`` becomes the index of its value in that list,
which is how a booster trained with those columns as categorical features expects them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import lightgbm
import numpy as np

from tailserve.errors import InvalidInput, ModelLoadError
from tailserve.modelconfig import TensorSpec
from tailserve.runtimes.base import Arrays, IOSpec, RuntimeContext, Signature
from tailserve.tensors import numpy_dtype

ARTIFACT = "model.txt"

# The names LightGBM gives features when training had none.
_UNNAMED = re.compile(r"Column_\d+")


@dataclass(frozen=True, slots=True)
class _Column:
    name: str
    start: int
    stop: int
    optional: bool
    codes: dict[str | bytes, int] | None


class LightGBMRuntime:
    steady = True  # compute alone: its time follows the batch's size

    def __init__(self, context: RuntimeContext) -> None:
        self.context = context
        self._where = context.where
        self._booster: lightgbm.Booster | None = None
        self._columns: tuple[_Column, ...] = ()
        self._width = 0
        threads = context.config.instances.intra_op_threads
        # 0 leaves the thread count to OpenMP, as it does for ONNX Runtime.
        self._predict_options: dict[str, Any] = {"num_threads": threads} if threads else {}

    def load(self) -> None:
        config = self.context.config
        if len(config.outputs) != 1:
            raise ModelLoadError(f"{self._where}: a LightGBM model has exactly one output")
        self._columns = self._plan(config.inputs)
        self._width = self._columns[-1].stop
        path = self.context.artifact(ARTIFACT)
        try:
            booster = lightgbm.Booster(model_file=str(path))
        except Exception as exc:
            raise ModelLoadError(f"{self._where}: cannot load {path}: {exc}") from exc
        if booster.num_feature() != self._width:
            raise ModelLoadError(
                f"{self._where}: {path} takes {booster.num_feature()} features but the inputs "
                f"of model.yaml make {self._width} columns"
            )
        per_row = booster.num_model_per_iteration()
        out = config.outputs[0]
        if math.prod(out.shape) != per_row:
            raise ModelLoadError(
                f"{self._where}: {path} gives {per_row} value(s) a row, output {out.name!r} "
                f"has shape {out.shape}"
            )
        self._check_names(booster.feature_name())
        self._booster = booster

    def _plan(self, specs: list[TensorSpec]) -> tuple[_Column, ...]:
        columns, start = [], 0
        for spec in specs:
            if -1 in spec.shape:
                raise ModelLoadError(
                    f"{self._where}: input {spec.name!r} has a variable shape {spec.shape}; "
                    "LightGBM needs a fixed number of columns"
                )
            codes: dict[str | bytes, int] | None = None
            if spec.datatype == "BYTES":
                if spec.values is None:
                    raise ModelLoadError(
                        f"{self._where}: BYTES input {spec.name!r} needs 'values' in model.yaml "
                        "to become a categorical column"
                    )
                codes = {}
                for index, value in enumerate(spec.values):
                    codes[value] = codes[value.encode()] = index
            stop = start + math.prod(spec.shape)
            columns.append(_Column(spec.name, start, stop, spec.optional, codes))
            start = stop
        return tuple(columns)

    def _check_names(self, names: list[str]) -> None:
        # A booster trained with the same names in another order would score garbage silently.
        ours = [c.name for c in self._columns if c.stop - c.start == 1]
        named = [n for n in names if not _UNNAMED.fullmatch(n)]
        if len(ours) == len(names) and sorted(ours) == sorted(named) and ours != named:
            raise ModelLoadError(
                f"{self._where}: model.yaml lists the inputs in another order than the booster's "
                f"features {names}"
            )

    def describe(self) -> Signature:
        booster = self._loaded()
        return Signature(inputs=tuple(IOSpec(name) for name in booster.feature_name()), outputs=())

    def predict(self, inputs: Arrays) -> Arrays:
        booster = self._loaded()
        config = self.context.config
        rows = self._rows(inputs)
        matrix = np.empty((rows, self._width), dtype=np.float64)
        for column in self._columns:
            block = matrix[:, column.start : column.stop]
            array = inputs.get(column.name)
            if array is None:
                if not column.optional:
                    raise InvalidInput(f"input {column.name!r} is missing")
                block[:] = np.nan  # LightGBM's "missing", routed by each split's default side
            elif column.codes is not None:
                block[:] = _encode(column, array).reshape(rows, -1)
            else:
                block[:] = array.reshape(rows, -1)
        scores = booster.predict(matrix, **self._predict_options)
        out = config.outputs[0]
        shape = [rows, *out.shape] if config.batched else out.shape
        return {out.name: np.asarray(scores).astype(numpy_dtype(out.datatype)).reshape(shape)}

    def _rows(self, inputs: Arrays) -> int:
        if not self.context.config.batched:
            return 1
        for array in inputs.values():
            return len(array)
        raise InvalidInput("no inputs")

    def unload(self) -> None:
        self._booster = None

    def _loaded(self) -> lightgbm.Booster:
        if self._booster is None:
            raise RuntimeError(f"{self._where}: not loaded")
        return self._booster


def _encode(column: _Column, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    codes = column.codes or {}
    try:
        return np.array([codes[item] for item in array.reshape(-1).tolist()], dtype=np.float64)
    except KeyError as exc:
        item = exc.args[0]
        shown = item.decode("utf-8", "replace") if isinstance(item, bytes) else item
        allowed = ", ".join(str(value) for value in codes if isinstance(value, str))
        raise InvalidInput(
            f"input {column.name!r}: unknown value {shown!r} (allowed: {allowed})"
        ) from None
