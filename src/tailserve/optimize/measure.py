"""Running the variants as a worker would: loaded through `create_runtime`, scored on the
held-out inputs, and timed batch by batch.

Timing interleaves the variants (one run of each in turn, the order rotating every round), so
a noisy neighbour on a shared machine slows them alike and their ratios hold; each batch size
is warmed first, then the median of ``repeat`` runs is its latency.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.engine.warmup import load_runtime
from tailserve.errors import ModelLoadError
from tailserve.modelconfig import ModelConfig, Variant
from tailserve.optimize.datasets import Array, Arrays, Dataset
from tailserve.runtimes import Runtime, RuntimeContext

WARM_RUNS = 3


def load(config: ModelConfig, version: int, version_dir: Path, variant: Variant | None) -> Runtime:
    """One instance of the variant (None: the model as it is), loaded as a worker loads it."""
    return load_runtime(RuntimeContext(config, version, version_dir, variant=variant))


def score(runtime: Runtime, config: ModelConfig, held_out: Dataset) -> dict[str, Array]:
    """The variant's outputs on the held-out inputs: each output concatenated, flat."""
    parts: dict[str, list[Array]] = {spec.name: [] for spec in config.outputs}
    for batch in held_out.batches:
        outputs = runtime.predict(batch)
        for name, found in parts.items():
            if name not in outputs:
                raise ModelLoadError(f"model {config.name!r}: no output {name!r}")
            found.append(np.asarray(outputs[name]).ravel())
    return {name: np.concatenate(found) for name, found in parts.items()}


def time_batches(
    runtimes: Mapping[str, Runtime],
    batches: Mapping[int, Arrays],
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[int, float]]:
    """Milliseconds a batch by variant and batch size: the median of ``repeat`` runs."""
    names = list(runtimes)
    latency: dict[str, dict[int, float]] = {name: {} for name in names}
    # Every shape once before any is timed: the first size timed ran slow (the process's first
    # runs: memory plans, caches) while the later ones had been warmed by it.
    for batch in batches.values():
        for runtime in runtimes.values():
            runtime.predict(batch)
    for size, batch in batches.items():
        for runtime in runtimes.values():
            for _ in range(WARM_RUNS):
                runtime.predict(batch)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(repeat):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                started = clock()
                runtimes[name].predict(batch)
                times[name].append(clock() - started)
        for name, runs in times.items():
            latency[name][size] = float(np.median(runs)) * 1000.0
    return latency


def artifact_size(version_dir: Path, variant: Variant, default: str | None) -> int | None:
    """Bytes of the variant's file; None for a variant of settings alone (its weights change
    in memory at load, which no file shows)."""
    if variant.artifact is not None:
        name: str | None = variant.artifact
    elif variant.parameters:
        return None
    else:
        name = default
    path = version_dir / name if name is not None else None
    return path.stat().st_size if path is not None and path.is_file() else None


def unload_all(runtimes: Mapping[str, Any]) -> None:
    for runtime in runtimes.values():
        # Releasing what goes away with the process anyway: one failure stops no other.
        with contextlib.suppress(Exception):
            runtime.unload()
