"""Cache keys: stable, collision-safe names for "this model version, these inputs".

A key hashes, in a fixed framing (every field length-prefixed, so no two inputs can run
together into the same bytes): the model's name, the serving version, a hash of the input
schema (names, datatypes, shapes of model.yaml's inputs), the feature version, each input
tensor sorted by name as datatype, shape and data, and the request parameters that change
the output. Inputs the model's key rule leaves out (volatile fields) are skipped; inputs it
rounds are snapped to their grid first, so near-identical requests share one result.

The key reads ``ts:{model}:v<version>:<digest>``: the braces are a Redis Cluster hash tag, so
one model's keys live in one slot (found together by MGET, scanned together on invalidation),
and the readable prefix lets invalidation go by model, version or prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.tensors import Tensor, to_binary

PREFIX = "ts"
_LENGTH = struct.Struct("<Q")


def model_prefix(model: str) -> str:
    return f"{PREFIX}:{{{model}}}:"


def version_prefix(model: str, version: int | str) -> str:
    return f"{model_prefix(model)}v{version}:"


def schema_hash(inputs: Iterable[tuple[str, str, Sequence[int]]]) -> str:
    """A short hash of the input schema: (name, datatype, per-row shape) of each input."""
    digest = hashlib.blake2b(digest_size=8)
    for name, datatype, shape in sorted(inputs):
        _frame(digest, name.encode())
        _frame(digest, datatype.encode())
        _frame(digest, ",".join(map(str, shape)).encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class KeyRule:
    """What of a request goes into its key: inputs left out, inputs rounded to a grid, and
    the request parameters that change the output."""

    exclude: frozenset[str] = frozenset()
    round: Mapping[str, float] = field(default_factory=dict)
    parameters: tuple[str, ...] = ()


class KeyBuilder:
    """The keys of one served version of one model."""

    __slots__ = ("_head", "_heads", "_plans", "_rule", "prefix")

    def __init__(
        self,
        model: str,
        version: int,
        schema: str,
        feature_version: str = "",
        rule: KeyRule | None = None,
    ) -> None:
        self._rule = rule or KeyRule()
        self.prefix = version_prefix(model, version)
        head = hashlib.blake2b(digest_size=16)
        for part in (model, str(version), schema, feature_version):
            _frame(head, part.encode())
        self._head = head
        # Each tensor's framed name, datatype and shape, made once per kind of tensor seen.
        self._heads: dict[tuple[str, str, tuple[int, ...]], bytes] = {}
        # Per kind of request (each tensor's name, datatype, dtype and shape, in the order
        # given) whose inputs are all plain numbers: the included tensors' places in name
        # order, each with its framed head and data length, so that such a request's key
        # takes one pass over its arrays' bytes (None: a kind the general way keys).
        self._plans: dict[tuple[Any, ...], tuple[tuple[int, bytes], ...] | None] = {}

    @property
    def lossy(self) -> bool:
        """Whether requests that differ can share a key (inputs left out or rounded): then a
        hit does not prove the request valid, as an identical, computed one would."""
        return bool(self._rule.exclude or self._rule.round)

    def key(self, tensors: Sequence[Tensor], parameters: Mapping[str, Any] | None = None) -> str:
        kind = tuple([(t.name, t.datatype, t.data.dtype, t.data.shape) for t in tensors])
        try:
            plan = self._plans[kind]
        except KeyError:
            plan = self._plan(tensors, kind)
        # One buffer, one hash update: per-field digest calls cost more than the hashing.
        parts: list[bytes]
        if plan is None:
            parts = self._parts(tensors)
        else:
            parts = []
            for place, head in plan:
                parts += (head, tensors[place].data.tobytes())
        rule = self._rule
        if rule.parameters:
            given = parameters or {}
            for name in rule.parameters:
                value = f"{name}\x00{given.get(name)!r}".encode()
                parts += (_LENGTH.pack(len(value)), value)
        digest = self._head.copy()
        digest.update(b"".join(parts))
        return self.prefix + digest.hexdigest()

    def _plan(
        self, tensors: Sequence[Tensor], kind: tuple[Any, ...]
    ) -> tuple[tuple[int, bytes], ...] | None:
        """The plan for requests of this ``kind`` (see `_plans`), kept."""
        rule = self._rule
        plan: tuple[tuple[int, bytes], ...] | None = None
        plain = all(
            t.data.dtype.kind in "biuf"
            and t.data.dtype.byteorder != ">"
            and t.name not in rule.round
            for t in tensors
        )
        if plain:
            plan = tuple(
                (
                    place,
                    self._framed_head(t.name, t.datatype, t.data.shape)
                    + _LENGTH.pack(t.data.nbytes),
                )
                for place, t in sorted(enumerate(tensors), key=lambda each: each[1].name)
                if t.name not in rule.exclude
            )
        if len(self._plans) >= _HEADS_KEPT:  # kinds a client can vary without end
            self._plans.clear()
        self._plans[kind] = plan
        return plan

    def _parts(self, tensors: Sequence[Tensor]) -> list[bytes]:
        """Each included tensor's framed head, length and canonical bytes, in name order."""
        rule = self._rule
        parts: list[bytes] = []
        for tensor in sorted(tensors, key=_name):
            if tensor.name in rule.exclude:
                continue
            array = tensor.data
            data = canonical_bytes(array, rule.round.get(tensor.name))
            parts += (
                self._framed_head(tensor.name, tensor.datatype, array.shape),
                _LENGTH.pack(len(data)),
                data,
            )
        return parts

    def _framed_head(self, name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
        known = (name, datatype, shape)
        framed = self._heads.get(known)
        if framed is None:
            head = f"{name}\x00{datatype}\x00{shape}".encode()
            framed = _LENGTH.pack(len(head)) + head
            if len(self._heads) >= _HEADS_KEPT:  # shapes a client can vary without end
                self._heads.clear()
            self._heads[known] = framed
        return framed


_HEADS_KEPT = 1024


def canonical_bytes(array: np.ndarray[Any, Any], grid: float | None = None) -> bytes:
    """The data of an array as bytes that do not depend on its memory layout.

    Numbers: little-endian, C order, after snapping to ``grid`` when given (the rounded value
    keeps the array's dtype family, so 1 and 1.0 of different datatypes still differ through
    the datatype framed beside them). BYTES: each element length-prefixed, str as UTF-8.
    """
    if array.dtype.kind == "O" or array.dtype.kind in "SU":
        out = bytearray()
        for item in array.reshape(-1).tolist():
            raw = item.encode() if isinstance(item, str) else bytes(item)
            out += _LENGTH.pack(len(raw))
            out += raw
        return bytes(out)
    if grid is not None and array.dtype.kind in "iuf":
        snapped = np.round(array.astype(np.float64) / grid) * grid
        # -0.0 and 0.0 are one value on the grid.
        snapped = snapped + 0.0
        return np.ascontiguousarray(snapped, dtype="<f8").tobytes()
    return to_binary(array)  # little-endian, C order whatever the memory layout


def _name(tensor: Tensor) -> str:
    return tensor.name


def _frame(digest: Any, data: bytes) -> None:
    digest.update(_LENGTH.pack(len(data)))
    digest.update(data)
