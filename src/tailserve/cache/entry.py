"""A cached result and its lineage, and their compact binary form for Redis.

The value is the model's outputs for one request (name → array), with where it came from:
the model and feature versions, when (Unix time) and where (worker id) it was computed, until
when it is fresh, and whether a precompute job wrote it. Encoded as MessagePack with the
arrays as raw little-endian bytes: a churn score is ~90 bytes, 500 ranker scores ~2.1 KB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from tailserve.tensors import DATATYPES, datatype_of

Outputs = dict[str, np.ndarray[Any, Any]]


class _Tensor(msgspec.Struct, array_like=True):
    name: str
    datatype: str
    shape: list[int]
    data: bytes | list[bytes]


class _Wire(msgspec.Struct, array_like=True):
    model_version: int
    feature_version: str
    computed_at: float
    computed_by: str
    fresh_until: float
    precomputed: bool
    outputs: list[_Tensor]
    variant: str = ""  # (last, with a default: entries written before it decode)


@dataclass(frozen=True, slots=True)
class Lineage:
    model_version: int
    feature_version: str
    computed_at: float  # Unix time
    computed_by: str  # the worker (host:pid) or job that computed it
    precomputed: bool = False
    variant: str = ""  # the model's variant that computed it ("": the model has none)


@dataclass(frozen=True, slots=True)
class CachedResult:
    outputs: Outputs
    lineage: Lineage
    fresh_until: float  # Unix time: past it (within the grace window) the value is stale

    @property
    def nbytes(self) -> int:
        return 96 + sum(_nbytes(array) for array in self.outputs.values())


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Wire)


def encode(result: CachedResult) -> bytes:
    tensors = []
    for name, array in result.outputs.items():
        datatype = datatype_of(array)
        data: bytes | list[bytes]
        if datatype == "BYTES":
            data = [x.encode() if isinstance(x, str) else bytes(x) for x in array.reshape(-1)]
        else:
            data = np.ascontiguousarray(array, dtype=DATATYPES[datatype]).tobytes()
        tensors.append(_Tensor(name, datatype, list(array.shape), data))
    lineage = result.lineage
    wire = _Wire(
        lineage.model_version,
        lineage.feature_version,
        lineage.computed_at,
        lineage.computed_by,
        result.fresh_until,
        lineage.precomputed,
        tensors,
        lineage.variant,
    )
    return _encoder.encode(wire)


def decode(raw: bytes) -> CachedResult:
    """Raises ``ValueError`` on bytes that are not a cached result."""
    try:
        wire = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a cached result: {exc}") from None
    outputs: Outputs = {}
    for tensor in wire.outputs:
        try:
            if isinstance(tensor.data, list):
                array = np.empty(len(tensor.data), dtype=object)
                array[:] = tensor.data
            else:
                array = np.frombuffer(tensor.data, dtype=DATATYPES[tensor.datatype])
            outputs[tensor.name] = array.reshape(tensor.shape)
        except (KeyError, ValueError, TypeError) as exc:  # (a datatype, size or shape of
            # another writer's making: a miss, never a 500)
            raise ValueError(f"not a cached result: tensor {tensor.name!r}: {exc!r}") from None
    lineage = Lineage(
        wire.model_version,
        wire.feature_version,
        wire.computed_at,
        wire.computed_by,
        wire.precomputed,
        wire.variant,
    )
    return CachedResult(outputs, lineage, wire.fresh_until)


def _nbytes(array: np.ndarray[Any, Any]) -> int:
    if array.dtype.kind == "O":
        return sum(len(x) if isinstance(x, bytes | str) else 8 for x in array.reshape(-1)) + 8
    return int(array.nbytes)
