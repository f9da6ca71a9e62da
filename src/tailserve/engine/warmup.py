"""Warm-up inputs: synthetic batches drawn from the input specs, and the explicit requests.

A model is not ready until every instance has run these, so the first real request does not pay
for lazy initialisation (ONNX Runtime's first run, allocator growth, imports inside predict).
The times of the warm shapes seed each cost class's model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tailserve.engine.buckets import Bucket, BucketRule
from tailserve.engine.validation import InputPlan
from tailserve.errors import ModelLoadError, TailserveError
from tailserve.modelconfig import ModelConfig, TensorSpec
from tailserve.runtimes import Runtime, RuntimeContext, create_runtime
from tailserve.tensors import Tensor, from_json, numpy_dtype

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


def load_and_warm(
    context: RuntimeContext, plan: InputPlan, buckets: BucketRule
) -> tuple[Runtime, list[tuple[Bucket, int, float]]]:
    """In the loader thread: load one instance, check it against model.yaml, warm it up.

    Returns the instance and, to seed the cost models, each warm-up shape's time by cost class
    once that shape is warm (`settled`)."""
    config = context.config
    where = context.where
    runtime = load_runtime(context)
    # Per input shape: a batch of it and the times of its runs.
    runs: dict[tuple[tuple[int, ...], ...], tuple[Arrays, list[float]]] = {}
    try:
        _check_signature(runtime, config, where)
        for batch in warmup_batches(config, buckets.by, buckets.warmup_lengths()):
            rows = len(next(iter(batch.values()))) if config.batched else None
            started = time.perf_counter()
            outputs = runtime.predict(batch)
            seconds = time.perf_counter() - started
            shapes = tuple(array.shape for array in batch.values())
            runs.setdefault(shapes, (batch, []))[1].append(seconds)
            for spec in config.outputs:
                out = outputs.get(spec.name)
                if out is None:
                    raise ModelLoadError(f"{where}: warm-up gave no output {spec.name!r}")
                if rows is not None and len(out) != rows:
                    raise ModelLoadError(
                        f"{where}: warm-up output {spec.name!r} has {len(out)} rows for {rows}"
                    )
    except TailserveError as exc:
        runtime.unload()
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: warm-up failed: {exc.message}") from exc
    except Exception as exc:
        runtime.unload()
        raise ModelLoadError(f"{where}: warm-up failed: {exc}") from exc
    timings = [
        _timing(config, plan, buckets, batch, settled(runtime, batch, times))
        # (A shape run once, repeat: 1 being the default, had only a cold run: _settled runs
        # it until warm, so every class starts from a measured time, not the flat guess.)
        for batch, times in runs.values()
    ]
    return runtime, timings


def load_runtime(context: RuntimeContext) -> Runtime:
    """One instance of the model (or of ``context.variant``), loaded: any failure is a load
    error naming the model, version and variant."""
    runtime = create_runtime(context)
    try:
        runtime.load()
    except TailserveError:
        raise
    except Exception as exc:
        # Third-party loaders raise anything; it becomes a load error at this boundary.
        raise ModelLoadError(f"{context.where}: load failed: {type(exc).__name__}: {exc}") from exc
    return runtime


# A shape's warm-up time is taken once two runs in a row agree within this share, after at
# most this many runs more than the warm-up made.
SETTLED_WITHIN = 0.25
MAX_EXTRA_RUNS = 3


def settled(
    runtime: Runtime,
    batch: Arrays,
    times: list[float],
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The time of a shape's batch once it is warm, to seed its class's cost model.

    The first run of a shape pays for lazy initialisation, and with ONNX Runtime the second
    too (it plans the memory of that shape then: 64 rows of 512 tokens took 447 ms, then
    1,115 ms, then 184 ms every time). Seeded with a cold time, a class's requests would be
    refused at low load as if they took ten times longer. So the batch runs again until two
    runs in a row agree."""
    times = times[1:]
    for _ in range(MAX_EXTRA_RUNS):
        if len(times) >= 2 and abs(times[-1] - times[-2]) <= SETTLED_WITHIN * times[-2]:
            break
        started = clock()
        runtime.predict(batch)
        times.append(clock() - started)
    return min(times[-2:]) if len(times) >= 2 else times[-1]


def _timing(
    config: ModelConfig, plan: InputPlan, buckets: BucketRule, batch: Arrays, seconds: float
) -> tuple[Bucket, int, float]:
    specs = {spec.name: spec for spec in config.inputs}
    tensors = [Tensor(name, specs[name].datatype, array) for name, array in batch.items()]
    checked = plan.check(tensors)
    return buckets.classify(checked), checked.rows, seconds


def _check_signature(runtime: Runtime, config: ModelConfig, where: str) -> None:
    signature = runtime.describe()
    # Only artifacts with typed graphs (ONNX) name their tensors reliably enough to insist.
    if not signature.inputs or any(spec.datatype is None for spec in signature.inputs):
        return
    have = {spec.name for spec in signature.inputs}
    for spec in config.inputs:
        if spec.name not in have:
            raise ModelLoadError(
                f"{where}: model.yaml input {spec.name!r} is not an input of the artifact "
                f"(it has {sorted(have)})"
            )
