"""Python models: a class in ``model.py``, imported afresh for every model instance.

The class (``parameters.class``, default ``Model``) is built as ``cls(version_dir=..., config=...)``
when its ``__init__`` takes those keywords, else ``cls()``; then ``load()`` runs if it has one.
``predict`` takes and returns a dict of arrays; ``unload()`` is optional too.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from tailserve.errors import ModelExecutionError, ModelLoadError, TailserveError
from tailserve.runtimes.base import Arrays, RuntimeContext, Signature

ARTIFACT = "model.py"

_instances = itertools.count(1)


class PythonRuntime:
    steady = False  # the model's own code may sleep, wait or do I/O

    def __init__(self, context: RuntimeContext) -> None:
        self.context = context
        self._where = context.where
        self._model: Any = None
        self._module_name: str | None = None

    def load(self) -> None:
        config = self.context.config
        path = self.context.artifact(ARTIFACT)
        module = self._import(path)
        class_name = str(self.context.parameters.get("class", "Model"))
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            self._forget_module()
            raise ModelLoadError(f"{self._where}: {path} defines no class {class_name!r}")
        if self.context.variant is not None and self.context.variant.parameters:
            # The model's code reads its settings from config.parameters: the variant's there.
            config = msgspec.structs.replace(config, parameters=self.context.parameters)
        try:
            if _takes_context(cls):
                model = cls(version_dir=self.context.version_dir, config=config)
            else:
                model = cls()
            if callable(getattr(model, "load", None)):
                model.load()
        except TailserveError:
            self._forget_module()
            raise
        except Exception as exc:
            self._forget_module()
            raise ModelLoadError(
                f"{self._where}: {class_name} in {path} failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        if not callable(getattr(model, "predict", None)):
            self._forget_module()
            raise ModelLoadError(f"{self._where}: {class_name} in {path} has no predict method")
        self._model = model

    def _import(self, path: Path) -> ModuleType:
        # A name of its own per instance: two versions (or instances) never share module state,
        # yet the module is in sys.modules while it lives, as dataclasses and pickle expect.
        slug = re.sub(r"\W", "_", self.context.config.name)
        name = f"tailserve_model_{slug}_v{self.context.version}_{next(_instances)}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelLoadError(f"{self._where}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        self._module_name = name
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            self._forget_module()
            raise ModelLoadError(
                f"{self._where}: importing {path} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return module

    def describe(self) -> Signature:
        # Python code declares no typed signature; model.yaml is the only source.
        return Signature(inputs=(), outputs=())

    def predict(self, inputs: Arrays) -> Arrays:
        if self._model is None:
            raise RuntimeError(f"{self._where}: not loaded")
        result = self._model.predict(inputs)
        if not isinstance(result, Mapping):
            raise ModelExecutionError(
                f"{self._where}: predict returned {type(result).__name__}, not a dict of arrays"
            )
        return dict(result)

    def unload(self) -> None:
        model, self._model = self._model, None
        try:
            if model is not None and callable(getattr(model, "unload", None)):
                model.unload()
        finally:
            self._forget_module()

    def _forget_module(self) -> None:
        if self._module_name is not None:
            sys.modules.pop(self._module_name, None)
            self._module_name = None


def _takes_context(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    return takes_any or {"version_dir", "config"} <= names
