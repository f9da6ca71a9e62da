"""The inputs the variants are made and judged with: calibration, held-out and timing batches.

By default they are synthetic draws from the input specs (`warmup_batches`), calibration and
held-out from different seeds; a ``.npz`` file of arrays named like the inputs, rows first,
replaces either (a held-out file may add ``labels``, 0 or 1 a row).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tailserve.engine.buckets import BucketRule
from tailserve.engine.warmup import warmup_batches
from tailserve.errors import ConfigError
from tailserve.modelconfig import ModelConfig, TensorSpec, Warmup
from tailserve.tensors import numpy_dtype

Array = np.ndarray[Any, Any]
Arrays = dict[str, Array]

CALIBRATION_SEED = 0
HELD_OUT_SEED = 1
TIMING_SEED = 2
# A padded sequence input is drawn at its cost classes' edges up to this length: every variant
# runs every held-out batch, and the longest classes would take most of the command's time.
LENGTH_LIMIT = 128
LABELS = "labels"


@dataclass(frozen=True, slots=True)
class Dataset:
    batches: list[Arrays]
    rows: int
    source: str  # how the report names it
    labels: Array | None = None


@dataclass(frozen=True, slots=True)
class Shape:
    """Where a model's cost varies with a sequence's length: that input, and the lengths drawn."""

    vary: str | None
    lengths: tuple[int, ...]

    @property
    def timing_length(self) -> int | None:
        """The one length the latency batches use (the middle of those drawn)."""
        return self.lengths[len(self.lengths) // 2] if self.lengths else None


def shape_of(config: ModelConfig) -> Shape:
    rule = BucketRule(config, classes=True)
    lengths = tuple(rule.warmup_lengths(limit=LENGTH_LIMIT))
    vary = rule.by if lengths and rule.by not in (None, "rows") else None
    return Shape(vary, lengths if vary is not None else ())


def synthetic(config: ModelConfig, seed: int, purpose: str) -> Dataset:
    shape = shape_of(config)
    batches = list(warmup_batches(config, shape.vary, shape.lengths, seed=seed))
    if not batches:
        raise ConfigError(f"model {config.name!r}: no warm-up inputs to draw {purpose} from")
    rows = sum(batch_rows(batch) for batch in batches) if config.batched else len(batches)
    return Dataset(batches, rows, f"synthetic draws from the input specs (seed {seed})")


def timing_batches(config: ModelConfig, sizes: list[int]) -> dict[int, Arrays]:
    """One batch a size, the same for every variant."""
    shape = shape_of(config)
    only = msgspec.structs.replace(config, warmup=Warmup(batch_sizes=sizes, repeat=1))
    lengths = [shape.timing_length] if shape.timing_length is not None else []
    draws = warmup_batches(only, shape.vary, lengths, seed=TIMING_SEED)
    if not config.batched:
        return {1: next(draws)}
    return {size: batch for size, batch in zip(sizes, draws, strict=False)}


def batch_rows(batch: Arrays) -> int:
    return int(next(iter(batch.values())).shape[0])


def load_npz(path: Path, config: ModelConfig, *, chunk: int, what: str) -> Dataset:
    """A file of arrays named like the model's inputs, rows first, cut into batches."""
    arrays = _read(path, what)
    specs = {spec.name: spec for spec in config.inputs}
    unknown = sorted(set(arrays) - set(specs) - {LABELS})
    if unknown:
        raise ConfigError(
            f"{what} {path}: array {unknown[0]!r} is not an input of model {config.name!r} "
            f"(inputs: {', '.join(specs)})"
        )
    missing = [name for name, spec in specs.items() if name not in arrays and not spec.optional]
    if missing:
        raise ConfigError(f"{what} {path}: no array for input {missing[0]!r}")
    columns = {
        name: _column(path, what, specs[name], array, config.batched)
        for name, array in arrays.items()
        if name != LABELS
    }
    rows = {len(column) for column in columns.values()}
    if len(rows) != 1:
        raise ConfigError(f"{what} {path}: the arrays have different numbers of rows: {rows}")
    (count,) = rows
    if count == 0:
        raise ConfigError(f"{what} {path}: no rows")
    labels = _labels(path, what, arrays[LABELS], count) if LABELS in arrays else None
    if config.batched:
        batches = [
            {name: column[start : start + chunk] for name, column in columns.items()}
            for start in range(0, count, chunk)
        ]
    else:
        batches = [{name: column[i] for name, column in columns.items()} for i in range(count)]
    return Dataset(batches, count, str(path), labels)


def _read(path: Path, what: str) -> Arrays:
    # allow_pickle=False: an object array needs a pickle, and a pickle runs code when read.
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{what} {path}: cannot read it as .npz: {exc}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ConfigError(f"{what} {path}: not an .npz file of named arrays")
    try:
        return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{what} {path}: cannot read it as .npz: {exc}") from None
    finally:
        data.close()


def _column(path: Path, what: str, spec: TensorSpec, array: Array, batched: bool) -> Array:
    where = f"{what} {path}: array {spec.name!r}"
    if batched and array.ndim == 1 and spec.shape == [1]:
        array = array.reshape(-1, 1)
    want = len(spec.shape) + 1
    if array.ndim != want or any(
        d != -1 and d != have for d, have in zip(spec.shape, array.shape[1:], strict=True)
    ):
        raise ConfigError(
            f"{where} has shape {list(array.shape)}; the input is [rows, "
            f"{', '.join(str(d) for d in spec.shape)}]"
        )
    if spec.datatype == "BYTES":
        if array.dtype.kind not in "US":
            raise ConfigError(f"{where} holds {array.dtype}, the input is BYTES (strings)")
        strings = np.empty(array.shape, dtype=object)
        flat = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.ravel()]
        strings.reshape(-1)[:] = flat
        return strings
    dtype = numpy_dtype(spec.datatype)
    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise ConfigError(f"{where} holds {array.dtype}, which does not fit {spec.datatype}")
    return array.astype(dtype)


def _labels(path: Path, what: str, labels: Array, rows: int) -> Array:
    flat = labels.ravel()
    if flat.size != rows:
        raise ConfigError(f"{what} {path}: {flat.size} labels for {rows} rows")
    if flat.dtype.kind not in "biuf" or not np.isin(flat, (0, 1)).all():
        raise ConfigError(f"{what} {path}: labels must be 0 or 1")
    return flat.astype(np.int64)
