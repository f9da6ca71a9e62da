"""Store-filled inputs: a model whose ``model.yaml`` has a ``features:`` section takes entity ids
where it would take feature vectors, and the resolver fills them in from the feature store
(`feature_store`). Each looked-up input has an in-process cache of rows in front of the store
(``ttl_s``, ``max_entries``): only its misses go to Redis, all of them in one read. Rows are kept
as the packed bytes of the model's fields, so a request's matrix is one join.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from tailserve.cache.feature_store import (
    FLOAT,
    ID_DATATYPES,
    FeatureSource,
    Matrix,
    check_names,
)
from tailserve.cache.memory import Lookup, MemoryCache
from tailserve.errors import ConfigError, InvalidInput
from tailserve.modelconfig import FeatureInput, FeaturesConfig, ModelConfig
from tailserve.tensors import Tensor


class FeatureObserver(Protocol):
    def on_feature_lookup(self, entity: str, result: str, count: int) -> None:
        """``count`` ids of ``entity`` looked up in the in-process cache with ``result``
        (``hit``, or why not: ``cold``, ``expired``, ``evicted``)."""


class _Lookup:
    """One store-filled input: its id checks and its in-process cache of packed rows."""

    __slots__ = ("cache", "fields", "per_row", "row_bytes", "spec", "ttl_s", "version")

    def __init__(
        self, spec: FeatureInput, config: FeaturesConfig, clock: Callable[[], float]
    ) -> None:
        self.spec = spec
        self.version = config.version
        self.fields = list(spec.fields)
        self.per_row = spec.shape == [-1]
        self.row_bytes = len(spec.fields) * FLOAT.itemsize
        self.ttl_s = config.ttl_s
        # FIFO (see cache/memory.py): one TTL for every entry, and hundreds of ids a request,
        # for which LRU's reordering cost as much again as the lookups (TinyLFU's, three times).
        self.cache = MemoryCache(
            max_entries=config.max_entries,
            max_bytes=config.max_entries * self.row_bytes,
            policy="fifo",
            clock=clock,
            enabled=config.ttl_s > 0,
        )

    def ids(self, tensor: Tensor) -> list[Any]:
        """The request's ids as Python ints or strs, checked against the spec."""
        spec = self.spec
        if tensor.datatype != spec.datatype:
            raise InvalidInput(
                f"input {spec.key!r}: datatype {tensor.datatype} does not match "
                f"the model's {spec.datatype} ({spec.entity} ids)"
            )
        data = tensor.data
        if data.size == 0:
            raise InvalidInput(f"input {spec.key!r}: holds no {spec.entity} ids")
        if not self.per_row:
            if data.size != 1:
                raise InvalidInput(
                    f"input {spec.key!r}: shape {list(data.shape)} holds "
                    f"{data.size} {spec.entity} ids; send one a request"
                )
        elif not (data.ndim == 1 or (data.ndim == 2 and data.shape[1] == 1)):
            raise InvalidInput(
                f"input {spec.key!r}: shape {list(data.shape)}: send one "
                f"{spec.entity} id a row, shape [N] or [N, 1]"
            )
        values: list[Any] = data.reshape(-1).tolist()
        if spec.datatype == "BYTES":
            values = [
                v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
                for v in values
            ]
        return values

    def cached(self, ids: list[Any]) -> tuple[list[Any], dict[str, Any], list[Lookup]]:
        """Packed rows from the cache (the cache key where missed), the misses by cache key
        (each once), and why each lookup missed."""
        keys = ids if self.spec.datatype == "BYTES" else [str(i) for i in ids]
        rows, missed, why = self.cache.get_many(keys)
        missing: dict[str, Any] = {}
        for position in missed:
            key = keys[position]
            missing.setdefault(key, ids[position])
            rows[position] = key  # a str stands in for the row until it is fetched
        return rows, missing, why

    def fill(self, rows: list[Any], missing: dict[str, Any], fetched: Matrix) -> list[bytes]:
        packed = {}
        put = self.cache.put
        for key, row in zip(missing, fetched, strict=True):
            raw = row.tobytes()
            packed[key] = raw
            put(key, raw, self.row_bytes, self.ttl_s)
        return [packed[row] if isinstance(row, str) else row for row in rows]


class FeatureResolver:
    """Replaces each request's id tensors with the model inputs looked up by them.

    For an input of ``shape: [1]`` (one entity a request, e.g. the user) its row is repeated
    for every row of the request; for ``shape: [-1]`` (one id a row, e.g. candidate items)
    the rows are the ids. A request that sends the model input itself instead of its ids
    passes it through unchanged."""

    def __init__(
        self,
        config: FeaturesConfig,
        store: FeatureSource,
        clock: Callable[[], float],
        *,
        observer: FeatureObserver | None = None,
    ) -> None:
        check_features_config(config)
        self.config = config
        self.store = store
        self.observer = observer
        self._lookups = [_Lookup(spec, config, clock) for spec in config.inputs]
        self._keys = {spec.key for spec in config.inputs}

    async def resolve(self, tensors: list[Tensor]) -> list[Tensor]:
        given = {tensor.name: tensor for tensor in tensors}
        chosen: list[tuple[_Lookup, list[Any]]] = []
        rows: int | None = None
        rows_from = ""
        for lookup in self._lookups:
            spec = lookup.spec
            id_tensor = given.get(spec.key)
            if id_tensor is None:
                if spec.input in given:
                    continue  # the client sent the features themselves
                raise InvalidInput(
                    f"input {spec.key!r} is missing: the model looks up "
                    f"{spec.input!r} by these {spec.entity} ids"
                )
            if spec.input in given:
                raise InvalidInput(f"send either {spec.key!r} or {spec.input!r}, not both")
            ids = lookup.ids(id_tensor)
            if lookup.per_row:
                if rows is not None and rows != len(ids):
                    raise InvalidInput(
                        f"input {spec.key!r}: {len(ids)} ids, but {rows_from!r} "
                        f"has {rows}: one id a row in each"
                    )
                rows, rows_from = len(ids), spec.key
            chosen.append((lookup, ids))
        if not chosen:
            return tensors
        if rows is None:
            others = (t for t in tensors if t.name not in self._keys and t.data.ndim > 0)
            rows = next((t.data.shape[0] for t in others), 1)
        matrices = await self._matrices(chosen)
        filled = {
            lookup.spec.key: (lookup, m) for (lookup, _), m in zip(chosen, matrices, strict=True)
        }
        out = []
        for tensor in tensors:
            found = filled.get(tensor.name)
            if found is None:
                out.append(tensor)
                continue
            lookup, matrix = found
            if not lookup.per_row:
                matrix = np.repeat(matrix, rows, axis=0)
            out.append(Tensor(lookup.spec.input, "FP32", matrix))
        return out

    async def warm(self) -> list[str]:
        """Make the store ready for every looked-up input at once (as many connections as a
        request's reads use), so that the first request does not wait for it. Returns what
        is not ready yet, in plain words: the store may be loaded or come up later, and a
        read then says so as it would have."""
        results = await asyncio.gather(
            *(
                self.store.prepare(lookup.spec.entity, lookup.version, lookup.fields)
                for lookup in self._lookups
            ),
            return_exceptions=True,
        )
        return [
            f"input {lookup.spec.key!r}: {result}"
            for lookup, result in zip(self._lookups, results, strict=True)
            if isinstance(result, Exception)
        ]

    async def _matrices(self, chosen: list[tuple[_Lookup, list[Any]]]) -> list[Matrix]:
        """Every input's rows: the cache's, and its misses from the store (the inputs' reads
        go out together, so a request waits for about one round trip)."""
        plans = []
        for lookup, ids in chosen:
            rows, missing, why = lookup.cached(ids)
            if self.observer is not None:
                self._observe(lookup.spec.entity, len(rows), why)
            plans.append((lookup, rows, missing))
        reads = [self._read(lookup, missing) for lookup, _, missing in plans if missing]
        if len(reads) > 1:
            fetched = iter(await asyncio.gather(*reads))
        else:
            fetched = iter([await read for read in reads])
        matrices = []
        for lookup, rows, missing in plans:
            packed = lookup.fill(rows, missing, next(fetched)) if missing else rows
            joined = bytearray().join(packed)
            matrices.append(np.frombuffer(joined, dtype=FLOAT).reshape(len(rows), -1))
        return matrices

    def _observe(self, entity: str, lookups: int, why: list[Lookup]) -> None:
        assert self.observer is not None
        # Entries never go stale (no grace window): a lookup that found one hit.
        if lookups > len(why):
            self.observer.on_feature_lookup(entity, Lookup.HIT.value, lookups - len(why))
        for result in (Lookup.COLD, Lookup.EXPIRED, Lookup.EVICTED):
            count = why.count(result)
            if count:
                self.observer.on_feature_lookup(entity, result.value, count)

    async def _read(self, lookup: _Lookup, missing: dict[str, Any]) -> Matrix:
        spec = lookup.spec
        try:
            ids = list(missing.values())
            return await self.store.read(spec.entity, lookup.version, ids, lookup.fields)
        except InvalidInput as exc:
            raise InvalidInput(f"input {spec.key!r}: {exc.message}") from None

    def clear(self) -> int:
        """Forget every cached row (after the store's rows were rewritten); how many."""
        return sum(lookup.cache.clear() for lookup in self._lookups)


# --- configuration checks ---------------------------------------------------------------------


def check_features_config(config: FeaturesConfig) -> None:
    """Raise ``ConfigError`` naming the field for a ``features:`` section that cannot work."""

    def fail(field: str, message: str) -> ConfigError:
        return ConfigError(f"field 'features.{field}': {message}")

    try:
        check_names("entity", config.version)
    except ConfigError as exc:
        raise fail("version", exc.message) from None
    if config.max_entries < 1:
        raise fail("max_entries", "must be >= 1")
    inputs: set[str] = set()
    keys: set[str] = set()
    for i, spec in enumerate(config.inputs):
        where = f"inputs[{i}]"
        try:
            check_names(spec.entity, config.version)
        except ConfigError as exc:
            raise fail(f"{where}.entity", exc.message) from None
        if spec.datatype not in ID_DATATYPES:
            raise fail(f"{where}.datatype", f"ids are {' or '.join(ID_DATATYPES)}")
        if spec.shape not in ([1], [-1]):
            raise fail(f"{where}.shape", "[1] (one id a request) or [-1] (one id a row)")
        if not spec.fields or len(set(spec.fields)) != len(spec.fields):
            raise fail(f"{where}.fields", "list the feature names, each once")
        if spec.input in inputs or spec.key in keys:
            raise fail(where, "each input and each id tensor is looked up once")
        inputs.add(spec.input)
        keys.add(spec.key)


def check_features(config: ModelConfig) -> None:
    """A model's ``features:`` against its inputs: each filled input is FP32 of one row of its
    fields (shape ``[len(fields)]``), and no id tensor shadows a model input."""
    if config.features is None:
        return
    check_features_config(config.features)
    for i, spec in enumerate(config.features.inputs):
        where = f"field 'features.inputs[{i}]'"
        target = config.input(spec.input)
        if target is None:
            raise ConfigError(f"{where}: {spec.input!r} is not an input of the model")
        if target.datatype != "FP32" or target.shape != [len(spec.fields)]:
            raise ConfigError(
                f"{where}: input {spec.input!r} must be FP32 of shape "
                f"[{len(spec.fields)}] (one value a field)"
            )
        if config.input(spec.key) is not None:
            raise ConfigError(f"{where}: the id tensor {spec.key!r} is also a model input")
