"""Warm-up inputs: synthetic batches drawn from the input specs, and the explicit requests.

A model is not ready until every instance has run these, so the first real request does not pay
for lazy initialisation (ONNX Runtime's first run, allocator growth, imports inside predict).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tailserve.modelconfig import ModelConfig, TensorSpec
from tailserve.tensors import from_json, numpy_dtype

Arrays = dict[str, np.ndarray[Any, Any]]


def warmup_batches(
    config: ModelConfig, vary: str | None = None, lengths: Sequence[int] = (), seed: int = 0
) -> Iterator[Arrays]:
    """Synthetic batches at each warm-up batch size (and, for a model that pads the variable
    input ``vary``, at each of ``lengths`` of it: every cost class runs before readiness),
    ``repeat`` times; then the explicit warm-up requests."""
    rng = np.random.default_rng(seed)
    sizes = config.warmup.batch_sizes if config.batched else [1]
    for _ in range(config.warmup.repeat):
        for size in sizes:
            for length in lengths or [1]:
                yield {
                    spec.name: _synthetic(config, spec, size, rng, _length(spec, vary, length))
                    for spec in config.inputs
                }
    for request in config.warmup.requests:
        arrays = {}
        for spec in config.inputs:
            data = request.inputs.get(spec.name)
            if data is None:
                continue
            shape = list(np.asarray(data, dtype=object).shape)
            arrays[spec.name] = from_json(spec.name, spec.datatype, shape, data)
        for _ in range(request.count):
            yield arrays


def _length(spec: TensorSpec, vary: str | None, length: int) -> int:
    return length if spec.name == vary else 1


def _synthetic(
    config: ModelConfig, spec: TensorSpec, rows: int, rng: np.random.Generator, length: int = 1
) -> np.ndarray[Any, Any]:
    dims = [d if d > 0 else length for d in spec.shape]
    shape = [rows, *dims] if config.batched else dims
    dtype = numpy_dtype(spec.datatype)
    if spec.datatype == "BYTES":
        choices = spec.values or ["warmup"]
        array = np.empty(shape, dtype=object)
        array.reshape(-1)[:] = [choices[i % len(choices)] for i in range(array.size)]
        return array
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    low, high = spec.range if spec.range is not None else (0.0, 1.0)
    if dtype.kind in "iu":
        return rng.integers(int(np.ceil(low)), int(np.floor(high)) + 1, size=shape).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)
