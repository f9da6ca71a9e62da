"""The feature store: entity features in Redis, and the in-process cache in front of it.

A model whose ``model.yaml`` has a ``features:`` section takes entity ids where it would take
feature vectors: a ranker's request names a user and 500 candidate items, and the worker looks
their features up. Layout in Redis, one hash per entity and feature version::

    tsf:{user}:v1        string: the version's field names, a JSON list, in stored order
    tsf:{user}:v1:42     hash: {"v": the features as little-endian float32, in that order}

``{user}`` is a hash tag: an entity type's keys share a cluster slot, so one command reads any
number of them. A row of 16 features is one 64-byte value. A read is one EVALSHA of a small
Lua script that returns the schema and every entity's value (500 items: ~1.2 ms on loopback;
a pipeline of 500 HGETs costs ~7.7 ms of client CPU, most of it parsing replies one by one).
The schema comes back with every read, so a version rewritten with other fields is seen at
once. Features of a version never change meaning: a new meaning is a new version, which the
model's ``features.version`` names (and the result cache's keys include).

In front of Redis, each looked-up input has an in-process cache of rows (``ttl_s``,
``max_entries``): only its misses go to Redis, all of them in one read. Rows are kept as the
packed bytes of the model's fields, so a request's matrix is one join.

Errors are converted here: an id the store does not hold is an ``InvalidInput`` (400) naming
the tensor, the entity and the id; Redis down, slow or holding no such version is
``Unavailable`` (503). A read waits at most ``timeout_s`` (250 ms); five failed or late reads
in a row open a breaker, and until a probe read succeeds the reads fail at once rather than
each waiting out its time for a Redis that is not answering (rows in the in-process cache are
served all the while).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import orjson

from tailserve.cache.breaker import Breaker
from tailserve.cache.memory import Lookup, MemoryCache
from tailserve.errors import ConfigError, InvalidInput, Unavailable
from tailserve.modelconfig import FeatureInput, FeaturesConfig, ModelConfig
from tailserve.tensors import Tensor

EntityId = int | str | bytes
Matrix = np.ndarray[Any, Any]

PREFIX = "tsf"
VALUE_FIELD = b"v"
_FLOAT = np.dtype("<f4")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
ID_DATATYPES = ("INT64", "BYTES")

# KEYS[1]: the schema; KEYS[2..]: entities. A missing key is Lua false, which Redis answers as
# nil, so the reply keeps one slot per key.
_READ = """
local out = {redis.call('GET', KEYS[1])}
for i = 2, #KEYS do out[i] = redis.call('HGET', KEYS[i], ARGV[1]) end
return out
"""


def schema_key(entity: str, version: str) -> str:
    return f"{PREFIX}:{{{entity}}}:v{version}"


def entity_key(entity: str, version: str, entity_id: EntityId) -> bytes:
    return schema_key(entity, version).encode() + b":" + _id_bytes(entity_id)


def _id_bytes(entity_id: EntityId) -> bytes:
    if isinstance(entity_id, bytes):
        return entity_id
    if isinstance(entity_id, str):
        return entity_id.encode("utf-8", "surrogateescape")
    return b"%d" % entity_id


def _check_names(entity: str, version: str) -> None:
    # Braces would break the hash tag, colons the key's parts, glob characters drop().
    for what, value in (("entity", entity), ("feature version", version)):
        if not _NAME.fullmatch(value):
            raise ConfigError(f"{what} {value!r}: use letters, digits, '_', '.' and '-' only")


def _some(ids: Sequence[Any], limit: int = 3) -> str:
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


class FeatureSource(Protocol):
    """What the resolver needs of a store (``FeatureStore``, or an in-memory twin in tests)."""

    async def read(
        self, entity: str, version: str, ids: Sequence[EntityId], fields: Sequence[str]
    ) -> Matrix: ...


class FeatureStore:
    """Features in Redis. ``client`` is a redis-py asyncio client (``cache.redis.connect``)
    that returns bytes (no ``decode_responses``), owned by the store from then on (``close``);
    reads wait at most ``timeout_s``, writes are pipelined ``chunk`` rows at a time."""

    def __init__(
        self,
        client: Any,
        *,
        timeout_s: float = 0.25,
        chunk: int = 2000,
        breaker: Breaker | None = None,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.chunk = chunk
        # Reads that Redis failed or did not answer in time, in a row, open it: the requests
        # after fail at once (503) rather than each waiting out ``timeout_s`` for nothing,
        # until a probe read succeeds (the L1 feature cache still answers what it holds).
        self.breaker = breaker or Breaker(clock=time.monotonic)
        self._script = client.register_script(_READ)
        # (raw schema, wanted fields) -> (stored width, columns to take; None: all, in order)
        self._columns: dict[tuple[bytes, tuple[str, ...]], tuple[int, list[int] | None]] = {}

    # --- reading ----------------------------------------------------------------------------

    async def read(
        self, entity: str, version: str, ids: Sequence[EntityId], fields: Sequence[str]
    ) -> Matrix:
        """The features of ``ids`` as float32 ``[len(ids), len(fields)]``, in one round trip.

        Raises ``InvalidInput`` naming the entity and ids the store does not hold, and
        ``Unavailable`` when Redis cannot answer in time or holds no such feature version."""
        if not ids:
            return np.empty((0, len(fields)), dtype=np.float32)
        prefix = schema_key(entity, version).encode() + b":"
        keys = [schema_key(entity, version).encode(), *(prefix + _id_bytes(i) for i in ids)]
        breaker = self.breaker
        if not breaker.allow():
            raise Unavailable(
                f"the feature store is failing ({entity} features): not asked again until a "
                f"probe succeeds",
                retry_after_s=1.0,
            )
        try:
            reply = await self._call(
                entity, lambda: self._script(keys=keys, args=[VALUE_FIELD]), self.timeout_s
            )
        except Unavailable:
            breaker.failure()
            raise
        except BaseException:
            breaker.release()  # (cancelled: a probe that says nothing either way)
            raise
        breaker.success()
        width, columns = self._layout(entity, version, reply[0], fields)
        values = reply[1:]
        missing = [entity_id for entity_id, value in zip(ids, values, strict=True) if not value]
        if missing:
            raise InvalidInput(
                f"unknown {entity} id{'s' if len(missing) > 1 else ''} {_some(missing)} "
                f"(feature version {version!r})"
            )
        joined = b"".join(values)
        if len(joined) != len(values) * width * _FLOAT.itemsize:
            bad = next(i for i, v in zip(ids, values, strict=True) if len(v) != width * 4)
            raise Unavailable(f"the feature store holds a malformed {entity} row for id {bad!r}")
        matrix = np.frombuffer(joined, dtype=_FLOAT).reshape(len(values), width)
        return matrix.copy() if columns is None else matrix[:, columns]

    def _layout(
        self, entity: str, version: str, raw: bytes | None, fields: Sequence[str]
    ) -> tuple[int, list[int] | None]:
        if raw is None:
            raise Unavailable(
                f"the feature store holds no {entity!r} features of version {version!r} "
                "(were they loaded?)"
            )
        wanted = tuple(fields)
        layout = self._columns.get((raw, wanted))
        if layout is None:
            stored = orjson.loads(raw)
            absent = [name for name in wanted if name not in stored]
            if absent:
                raise Unavailable(
                    f"the feature store's {entity!r} features of version {version!r} lack "
                    f"{_some(absent)}"
                )
            columns = [stored.index(name) for name in wanted]
            same = columns == list(range(len(stored)))
            layout = (len(stored), None if same else columns)
            if len(self._columns) > 64:  # schemas change rarely; stay bounded regardless
                self._columns.clear()
            self._columns[(raw, wanted)] = layout
        return layout

    async def fields(self, entity: str, version: str) -> list[str] | None:
        """The field names stored for this entity and version, or None if none are."""
        key = schema_key(entity, version)
        raw = await self._call(entity, lambda: self.client.get(key), self.timeout_s)
        return None if raw is None else list(orjson.loads(raw))

    # --- writing (loading) ------------------------------------------------------------------

    async def write(
        self,
        entity: str,
        version: str,
        rows: Mapping[EntityId, Mapping[str, float]],
        *,
        fields: Sequence[str] | None = None,
    ) -> int:
        """Store rows of named features (every row the same fields); return how many."""
        if not rows:
            return 0
        names = list(fields) if fields is not None else list(next(iter(rows.values())))
        values = np.empty((len(rows), len(names)), dtype=np.float32)
        for r, (entity_id, row) in enumerate(rows.items()):
            if len(row) != len(names):
                raise InvalidInput(
                    f"{entity} id {entity_id!r}: has fields {sorted(row)}, expected {sorted(names)}"
                )
            try:
                values[r] = [row[name] for name in names]
            except KeyError as exc:
                raise InvalidInput(f"{entity} id {entity_id!r}: no field {exc.args[0]!r}") from None
        return await self.write_matrix(entity, version, list(rows), names, values)

    async def write_matrix(
        self,
        entity: str,
        version: str,
        ids: Sequence[EntityId],
        fields: Sequence[str],
        values: Matrix,
    ) -> int:
        """Store ``values[i]`` (columns in ``fields`` order) as the features of ``ids[i]``, in
        pipelines of ``chunk`` rows. A version's fields are fixed by its first write: a later
        write must bring the same fields (in any order)."""
        _check_names(entity, version)
        if len(set(fields)) != len(fields) or not fields:
            raise InvalidInput(f"{entity} fields {list(fields)}: name each field once")
        matrix = np.asarray(values, dtype=_FLOAT)
        if matrix.shape != (len(ids), len(fields)):
            raise InvalidInput(
                f"{entity} features: shape {list(matrix.shape)} is not "
                f"[{len(ids)} ids, {len(fields)} fields]"
            )
        schema = schema_key(entity, version)
        proposed = orjson.dumps(list(fields))

        async def claim() -> Any:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.set(schema, proposed, nx=True)
                pipe.get(schema)
                return await pipe.execute()

        _, raw = await self._call(entity, claim, None)
        stored = list(orjson.loads(raw))
        if stored != list(fields):
            if sorted(stored) != sorted(fields):
                raise InvalidInput(
                    f"{entity} features of version {version!r} hold fields "
                    f"{stored}, not {list(fields)}: write a new version"
                )
            matrix = matrix[:, [list(fields).index(name) for name in stored]]
        matrix = np.ascontiguousarray(matrix)
        prefix = schema.encode() + b":"
        for start in range(0, len(ids), self.chunk):
            part = ids[start : start + self.chunk]
            rows = matrix[start : start + self.chunk]

            async def send(part: Sequence[EntityId] = part, rows: Matrix = rows) -> Any:
                async with self.client.pipeline(transaction=False) as pipe:
                    for entity_id, row in zip(part, rows, strict=True):
                        pipe.hset(prefix + _id_bytes(entity_id), VALUE_FIELD, row.tobytes())
                    return await pipe.execute()

            await self._call(entity, send, None)
        return len(ids)

    async def drop(self, entity: str, version: str) -> int:
        """Delete one version of an entity's features (SCAN + UNLINK); how many keys."""
        _check_names(entity, version)
        schema = schema_key(entity, version)

        async def scan_and_unlink() -> int:
            dropped = 0
            batch: list[Any] = [schema]
            async for key in self.client.scan_iter(match=schema + ":*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    dropped += int(await self.client.unlink(*batch))
                    batch = []
            if batch:
                dropped += int(await self.client.unlink(*batch))
            return dropped

        result: int = await self._call(entity, scan_and_unlink, None)
        return result

    async def close(self) -> None:
        """Close the client (the store owns the one it was given)."""
        with contextlib.suppress(Exception):
            await self.client.aclose()

    # --- the boundary -----------------------------------------------------------------------

    async def _call(self, entity: str, call: Callable[[], Any], limit: float | None) -> Any:
        """Await ``call()`` for at most ``limit`` seconds (None: the client's own socket
        timeout), converting Redis faults and slowness to ``Unavailable``."""
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(limit):
                return await call()
        except TimeoutError:
            raise Unavailable(
                f"the feature store did not answer within {limit * 1e3:g} ms ({entity} features)"
                if limit is not None
                else f"the feature store timed out ({entity} features)",
                retry_after_s=1.0,
            ) from None
        except (RedisError, OSError) as exc:
            raise Unavailable(
                f"the feature store failed ({entity} features): {type(exc).__name__}: {exc}",
                retry_after_s=1.0,
            ) from None


# --- the resolver -----------------------------------------------------------------------------


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
        self.row_bytes = len(spec.fields) * _FLOAT.itemsize
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
            matrices.append(np.frombuffer(joined, dtype=_FLOAT).reshape(len(rows), -1))
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
        _check_names("entity", config.version)
    except ConfigError as exc:
        raise fail("version", exc.message) from None
    if config.max_entries < 1:
        raise fail("max_entries", "must be >= 1")
    inputs: set[str] = set()
    keys: set[str] = set()
    for i, spec in enumerate(config.inputs):
        where = f"inputs[{i}]"
        try:
            _check_names(spec.entity, config.version)
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
