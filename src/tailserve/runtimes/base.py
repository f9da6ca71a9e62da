"""The one small interface every model backend implements.

A runtime is built from a `RuntimeContext`, loads its artifact, and predicts a batch of named
arrays. Every method may block: the engine calls them from executor threads. The one exception
is ``predict`` on a runtime that says it is ``steady`` (pure computation, no I/O, no sleeps, no
waiting on anything else, so its time follows its batch's size): a batch the cost model
predicts to take well under a millisecond then runs on the event loop's thread (see
engine/scheduler.py). One runtime object is one model instance; the engine builds as many as
the model's ``instances.count`` and never calls ``predict`` on one object from two threads at
once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tailserve.errors import ModelLoadError
from tailserve.modelconfig import ModelConfig, Variant

Arrays = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True, slots=True)
class IOSpec:
    """What the artifact itself says about a tensor (``None``: the artifact does not say)."""

    name: str
    datatype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Signature:
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]


@dataclass(frozen=True, slots=True)
class RuntimeContext:
    config: ModelConfig
    version: int
    version_dir: Path
    # The form of the model to load (model.yaml's ``variants``); None: the model itself.
    variant: Variant | None = None

    @property
    def where(self) -> str:
        """How errors name this model version (and variant)."""
        named = f" variant {self.variant.name!r}" if self.variant is not None else ""
        return f"model {self.config.name!r} version {self.version}{named}"

    @property
    def parameters(self) -> dict[str, Any]:
        """The runtime's settings: the model's ``parameters``, with the variant's over them."""
        if self.variant is None or not self.variant.parameters:
            return self.config.parameters
        return {**self.config.parameters, **self.variant.parameters}

    def artifact(self, filename: str) -> Path:
        """The version folder's file (the variant's own where it names one), or a load error
        naming the model, version and path."""
        if self.variant is not None and self.variant.artifact is not None:
            filename = self.variant.artifact
        path = self.version_dir / filename
        if not path.is_file():
            raise ModelLoadError(f"{self.where}: {path} not found")
        return path


class Runtime(Protocol):
    # Whether a cheap batch may run on the event loop's thread (see above). A Python model's
    # own code may sleep, wait or do I/O, so its runtime is not.
    steady: bool

    def load(self) -> None:
        """Read the artifact from ``context.version_dir``; raise ModelLoadError on failure."""

    def describe(self) -> Signature:
        """The inputs and outputs the loaded artifact declares (checked against model.yaml)."""

    def predict(self, inputs: Arrays) -> Arrays:
        """Score one batch: arrays with a leading batch dimension when the model batches."""

    def unload(self) -> None:
        """Release what ``load`` took."""
