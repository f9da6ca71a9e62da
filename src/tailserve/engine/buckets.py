"""Cost classes ("buckets"): which requests may share a batch, and how they are padded.

A request's cost class comes from its shape, by the model's `batching.cost` rule: its rows, or
the length of one input's variable dimension (a sequence length, a candidate count), placed
at the first class edge at or above it. Requests of different classes never share a batch, so
a 10-token request never waits behind, or is padded to, a 2,000-token one. With a
`pad_value`, every length in the class batches together: the variable input is padded to the
longest in the batch, rounded up to a multiple of 8 (a bounded set of shapes for the runtime
to warm) and never past the class's edge; without one, a class still only batches requests of
identical shapes. (Padding every batch to its edge cost `sentiment`'s model thread about 30%
more time a request than running each request at its own length: a length spread evenly
between two power-of-two edges pads by a third on average.)

The baseline policies have no classes: with a `pad_value`, every length batches together,
padded to the longest in the batch (what most serving code does); else identical shapes only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from tailserve.engine.validation import Checked
from tailserve.modelconfig import ModelConfig, cost_rule

Arrays = dict[str, np.ndarray[Any, Any]]

# "auto" edges: powers of two up to these.
_AUTO_LENGTH = (8, 8192)
# Within a class, a batch is padded to its longest request rounded up to a multiple of this.
PAD_GRANULE = 8


@dataclass(frozen=True, slots=True)
class Pad:
    input: str
    axis: int  # of the batched array (0 is the rows)
    length: int | None  # the class's edge: padded no further; None: to the longest in the batch
    value: float


@dataclass(frozen=True, slots=True)
class Bucket:
    key: Hashable  # requests batch together only within one key
    label: str  # for metrics and stats
    pad: Pad | None = None
    # Which of the model's variants runs it (engine/variants.py): 0, the first, by default.
    variant: int = 0

    def on(self, variant: int, name: str) -> Bucket:
        """This class as run by another variant: its own queue and cost model."""
        return Bucket((variant, self.key), f"{name}/{self.label}", self.pad, variant)


class BucketRule:
    def __init__(self, config: ModelConfig, *, classes: bool) -> None:
        self.model = config.name
        rule = cost_rule(config) if config.batched else None
        self.by = rule.by if rule is not None else None
        self.edges: list[int] = []
        if rule is not None and classes:
            self.edges = _edges(rule.edges, rule.by, config.max_batch_size)
        self.axis = 0
        self.pad_value = config.batching.pad_value if config.batched else None
        if self.by not in (None, "rows"):
            spec = config.input(self.by or "")
            assert spec is not None  # checked with the config
            self.axis = 1 + spec.shape.index(-1)
        self._names = [spec.name for spec in config.inputs]
        self._classes = classes

    def classify(self, checked: Checked) -> Bucket:
        by = self.by
        if by is None:
            return Bucket(checked.group, "all")
        if by == "rows":
            return self._place(checked.group, checked.rows, "rows")
        array = checked.arrays.get(by)
        if array is None:  # an optional input left out
            return Bucket(checked.group, "all")
        length = int(array.shape[self.axis])
        if self.pad_value is None:
            return self._place(checked.group, length, by)
        group = self._wildcard(checked)
        if not self._classes:
            return Bucket(group, "all", Pad(by, self.axis, None, self.pad_value))
        index = bisect_left(self.edges, length)
        if index == len(self.edges):
            return Bucket((checked.group, "over"), f"{by}>{self.edges[-1]}")
        edge = self.edges[index]
        return Bucket((group, edge), f"{by}<={edge}", Pad(by, self.axis, edge, self.pad_value))

    def warmup_lengths(self, limit: int = 1024) -> list[int]:
        """Lengths of the padded input to warm up at: each class edge (up to ``limit``)."""
        if self.pad_value is None or not self.edges:
            return []
        return [edge for edge in self.edges if edge <= limit] or self.edges[:1]

    def _place(self, group: Hashable, measure: int, name: str) -> Bucket:
        if not self.edges:
            return Bucket(group, "all")
        index = bisect_left(self.edges, measure)
        if index == len(self.edges):
            return Bucket((group, "over"), f"{name}>{self.edges[-1]}")
        edge = self.edges[index]
        return Bucket((group, edge), f"{name}<={edge}")

    def _wildcard(self, checked: Checked) -> Hashable:
        """The group with the padded dimension left out: every length of it batches."""
        names, shapes = cast(tuple[tuple[str, ...], tuple[tuple[int, ...], ...]], checked.group)
        position = names.index(self.by or "")
        shape = list(shapes[position])
        shape[self.axis - 1] = -1
        return names, (*shapes[:position], tuple(shape), *shapes[position + 1 :])


def _edges(edges: list[int] | str, by: str, max_rows: int) -> list[int]:
    if not isinstance(edges, str):
        return list(edges)
    low, high = (1, max(1, max_rows)) if by == "rows" else _AUTO_LENGTH
    result, edge = [], low
    while edge < high:
        result.append(edge)
        edge *= 2
    return [*result, high]


def pad_parts(parts: list[Arrays], pad: Pad) -> list[Arrays]:
    """Each request's padded input widened to the batch's width, others as is: the longest in
    the batch, rounded up to a multiple of `PAD_GRANULE` within the class's edge (without an
    edge, the longest as it is)."""
    lengths = [part[pad.input].shape[pad.axis] for part in parts if pad.input in part]
    if not lengths:
        return parts
    target = max(lengths)
    if pad.length is not None:
        target = max(target, min(pad.length, -(-target // PAD_GRANULE) * PAD_GRANULE))
    out = []
    for part in parts:
        array = part.get(pad.input)
        if array is None or array.shape[pad.axis] == target:
            out.append(part)
            continue
        shape = list(array.shape)
        shape[pad.axis] = target
        # (np.full and a copy: np.pad costs several times more in Python per call.)
        padded = np.full(shape, np.asarray(pad.value, dtype=array.dtype), dtype=array.dtype)
        padded[(slice(None),) * pad.axis + (slice(0, array.shape[pad.axis]),)] = array
        out.append({**part, pad.input: padded})
    return out
