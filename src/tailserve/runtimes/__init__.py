"""Model backends behind the one `Runtime` interface, chosen by ``runtime:`` in model.yaml."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tailserve.errors import ModelLoadError
from tailserve.runtimes.base import Arrays, IOSpec, Runtime, RuntimeContext, Signature

__all__ = [
    "Arrays",
    "IOSpec",
    "Runtime",
    "RuntimeContext",
    "Signature",
    "create_runtime",
    "import_backend",
]

# Imported lazily so a worker that serves only ONNX models never imports LightGBM or sklearn.
_BACKENDS: dict[str, str] = {
    "onnx": "tailserve.runtimes.onnx:OnnxRuntime",
    "lightgbm": "tailserve.runtimes.lightgbm:LightGBMRuntime",
    "sklearn": "tailserve.runtimes.sklearn:SklearnRuntime",
    "python": "tailserve.runtimes.python:PythonRuntime",
    "torch": "tailserve.runtimes.torch:TorchRuntime",
}


def import_backend(name: str) -> bool:
    """Import runtime ``name``'s module and its library (once a process: they are shared by
    every model of that runtime, so a model's measured memory does not include them); False
    for a runtime that has no module, or whose package is missing."""
    if name not in _BACKENDS:
        return False
    try:
        importlib.import_module(_BACKENDS[name].partition(":")[0])
    except ImportError:
        return False
    return True


def create_runtime(context: RuntimeContext) -> Runtime:
    name = context.config.runtime
    module_name, _, class_name = _BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"model {context.config.name!r}: runtime {name!r} needs a package that is not "
            f"installed ({exc.name}); install the 'tailserve[{name}]' extra"
        ) from exc
    factory: Callable[[RuntimeContext], Runtime] = getattr(module, class_name)
    return factory(context)
