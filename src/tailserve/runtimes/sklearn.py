"""scikit-learn: a fitted estimator or pipeline in ``model.joblib``, loaded only when trusted.

``parameters`` in model.yaml choose what is called: ``method`` (default ``predict_proba`` where
the estimator has it, else ``predict``) and ``column`` (take that column of the result).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import joblib
import numpy as np

from tailserve.errors import InvalidInput, ModelExecutionError, ModelLoadError
from tailserve.runtimes.base import Arrays, RuntimeContext, Signature
from tailserve.tensors import numpy_dtype

ARTIFACT = "model.joblib"


class SklearnRuntime:
    steady = True  # compute alone: its time follows the batch's size

    def __init__(self, context: RuntimeContext) -> None:
        self.context = context
        self._where = context.where
        self._estimator: Any = None
        self._method: Any = None
        self._take: int | None = None
        self._order: list[str] = [spec.name for spec in context.config.inputs]
        self._frame: Any = None  # pandas.DataFrame, when the estimator was fitted on one
        self._limits: Callable[[], AbstractContextManager[Any]] = nullcontext

    def load(self) -> None:
        config = self.context.config
        path = self.context.artifact(ARTIFACT)
        if not config.trust:
            raise ModelLoadError(
                f"{self._where}: refusing to load {path}: pickles run code on load; if the file "
                "is trusted, set 'trust: true' in model.yaml"
            )
        if len(config.outputs) != 1:
            raise ModelLoadError(f"{self._where}: a scikit-learn model has exactly one output")
        try:
            estimator = joblib.load(path)
        except Exception as exc:
            raise ModelLoadError(f"{self._where}: cannot load {path}: {exc}") from exc
        default = "predict_proba" if hasattr(estimator, "predict_proba") else "predict"
        name = str(self.context.parameters.get("method", default))
        method = getattr(estimator, name, None)
        if not callable(method):
            raise ModelLoadError(
                f"{self._where}: field 'parameters.method': {type(estimator).__name__} has no "
                f"method {name!r}"
            )
        column = self.context.parameters.get("column")
        if column is not None and not isinstance(column, int):
            raise ModelLoadError(f"{self._where}: field 'parameters.column' must be an integer")
        self._plan_columns(estimator)
        self._estimator, self._method, self._take = estimator, method, column
        self._limits = _thread_limits(config.instances.intra_op_threads)

    def _plan_columns(self, estimator: Any) -> None:
        fitted = getattr(estimator, "feature_names_in_", None)
        if fitted is None:
            return
        names = [str(name) for name in fitted]
        specs = {spec.name: spec for spec in self.context.config.inputs}
        for name in names:
            spec = specs.get(name)
            if spec is None or math.prod(spec.shape) != 1:
                raise ModelLoadError(
                    f"{self._where}: the estimator was fitted on a column {name!r}; model.yaml "
                    "needs an input of that name with shape [1]"
                )
        # Fitted on named columns: feed them by name, in the order the estimator saw them.
        self._order = names
        try:
            self._frame = importlib.import_module("pandas").DataFrame
        except ImportError:
            self._frame = None

    def describe(self) -> Signature:
        # A pickle declares no typed signature; model.yaml is the only source.
        return Signature(inputs=(), outputs=())

    def predict(self, inputs: Arrays) -> Arrays:
        config = self.context.config
        if self._method is None:
            raise RuntimeError(f"{self._where}: not loaded")
        columns = [self._column(name, inputs) for name in self._order]
        rows = len(columns[0])
        if self._frame is not None:
            named = {name: col[:, 0] for name, col in zip(self._order, columns, strict=True)}
            features: Any = self._frame(named)
        else:
            features = columns[0] if len(columns) == 1 else np.hstack(columns)
        with self._limits():
            result = np.asarray(self._method(features))
        if self._take is not None:
            result = result[:, self._take]
        out = config.outputs[0]
        if result.size != rows * math.prod(out.shape):
            raise ModelExecutionError(
                f"{self._where}: {result.shape} from the estimator does not fit output "
                f"{out.name!r} of shape {out.shape}"
            )
        shape = [rows, *out.shape] if config.batched else out.shape
        return {out.name: result.reshape(shape).astype(numpy_dtype(out.datatype), copy=False)}

    def _column(self, name: str, inputs: Arrays) -> np.ndarray[Any, Any]:
        """One input as a 2-D block of columns: (rows, values a row)."""
        array = inputs.get(name)
        if array is None:
            raise InvalidInput(f"input {name!r} is missing")
        rows = len(array) if self.context.config.batched else 1
        array = array.reshape(rows, -1)
        if array.dtype.kind == "O":
            # Binary requests carry bytes, JSON ones str; estimators were fitted on str.
            items = [i.decode("utf-8") if isinstance(i, bytes) else i for i in array.flat]
            text = np.empty(len(items), dtype=object)
            text[:] = items
            array = text.reshape(rows, -1)
        return array

    def unload(self) -> None:
        self._estimator = self._method = self._frame = None


def _thread_limits(threads: int) -> Callable[[], AbstractContextManager[Any]]:
    """BLAS/OpenMP thread limits for each predict call, where threadpoolctl is installed."""
    if threads == 0:
        return nullcontext
    try:
        threadpoolctl = importlib.import_module("threadpoolctl")
    except ImportError:
        return nullcontext
    # One controller found at load: threadpool_limits() would rescan the loaded libraries per call.
    controller = threadpoolctl.ThreadpoolController()
    return partial(controller.limit, limits=threads)
