"""The feature store: entity features in Redis, read by id (the resolver in `features` keeps
an in-process cache of rows in front of it).

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
of an entity type in a row open its breaker, and until a probe read succeeds its reads fail at
once rather than each waiting out its time for a Redis that is not answering (rows in the
in-process cache are served all the while). The breaker is the entity type's because its keys
share a slot: on a cluster, a dead master refuses the reads of its entities only, and a probe
reads the slot map afresh first (its replica may have taken over).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import orjson

from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.redis import on_slot_owner, refresh_slots
from tailserve.errors import ConfigError, InvalidInput, Unavailable

EntityId = int | str | bytes
Matrix = np.ndarray[Any, Any]

PREFIX = "tsf"
VALUE_FIELD = b"v"
FLOAT = np.dtype("<f4")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
ID_DATATYPES = ("INT64", "BYTES")

# How long `prepare` waits: a first connection at start may take longer than a read.
_PREPARE_S = 2.0

# KEYS[1]: the schema; KEYS[2..]: entities. A missing key is Lua false, which Redis answers as
# nil, so the reply keeps one slot per key.
_READ = """
local out = {redis.call('GET', KEYS[1])}
for i = 2, #KEYS do out[i] = redis.call('HGET', KEYS[i], ARGV[1]) end
return out
"""
# KEYS: entities; ARGV[1]: the field; ARGV[i + 1]: KEYS[i]'s value. One command a chunk: a
# pipeline of HSETs cost the client ~40 us of CPU a row (packing and reading each one).
_WRITE = """
for i = 1, #KEYS do redis.call('HSET', KEYS[i], ARGV[1], ARGV[i + 1]) end
return #KEYS
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


def check_names(entity: str, version: str) -> None:
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
        self,
        entity: str,
        version: str,
        ids: Sequence[EntityId],
        fields: Sequence[str],
        *,
        timeout_s: float | None = None,
    ) -> Matrix: ...

    async def prepare(self, entity: str, version: str, fields: Sequence[str]) -> None: ...


class FeatureStore:
    """Features in Redis. ``client`` is a redis-py asyncio client (``cache.redis.connect``)
    that returns bytes (no ``decode_responses``), owned by the store from then on (``close``);
    reads wait at most ``timeout_s``, writes send ``chunk`` rows a command."""

    def __init__(
        self,
        client: Any,
        *,
        timeout_s: float = 0.25,
        chunk: int = 2000,
        breaker: Breaker | None = None,
        cluster: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.cluster = cluster  # a RedisCluster client
        self._clock = clock  # the breakers'
        self.timeout_s = timeout_s
        self.chunk = chunk
        # Reads that Redis failed or did not answer in time, in a row, open an entity type's
        # breaker: its requests after fail at once (503) rather than each waiting out
        # ``timeout_s`` for nothing, until a probe read succeeds (the L1 feature cache still
        # answers what it holds). One for every entity type when ``breaker`` is given.
        self._shared = breaker
        self._breakers: dict[str, Breaker] = {}
        self._sha = hashlib.sha1(_READ.encode()).hexdigest()
        self._write_sha = hashlib.sha1(_WRITE.encode()).hexdigest()
        # (raw schema, wanted fields) -> (stored width, columns to take; None: all, in order)
        self._columns: dict[tuple[bytes, tuple[str, ...]], tuple[int, list[int] | None]] = {}

    # --- reading ----------------------------------------------------------------------------

    async def read(
        self,
        entity: str,
        version: str,
        ids: Sequence[EntityId],
        fields: Sequence[str],
        *,
        timeout_s: float | None = None,
    ) -> Matrix:
        """The features of ``ids`` as float32 ``[len(ids), len(fields)]``, in one round trip,
        within ``timeout_s`` (else the store's own).

        Raises ``InvalidInput`` naming the entity and ids the store does not hold, and
        ``Unavailable`` when Redis cannot answer in time or holds no such feature version."""
        if not ids:
            return np.empty((0, len(fields)), dtype=np.float32)
        prefix = schema_key(entity, version).encode() + b":"
        keys = [schema_key(entity, version).encode(), *(prefix + _id_bytes(i) for i in ids)]
        breaker = self.breaker(entity)
        if not breaker.allow():
            raise Unavailable(
                f"the feature store is failing ({entity} features): not asked again until a "
                f"probe succeeds",
                retry_after_s=1.0,
            )
        probe = self.cluster and breaker.state is BreakerState.HALF_OPEN

        async def call() -> Any:
            from redis.exceptions import ConnectionError as Dropped

            if probe:
                await refresh_slots(self.client)
            try:
                return await self._run_read(keys)
            except (Dropped, ConnectionError, RuntimeError) as exc:
                if isinstance(exc, RuntimeError) and "closed" not in str(exc):
                    raise
                # A connection closed under the read (another read's probe re-read the slot
                # map and dropped it): a read is safe to send again, on a fresh connection.
                return await self._run_read(keys)

        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            reply = await self._call(entity, call, limit)
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
        if len(joined) != len(values) * width * FLOAT.itemsize:
            bad = next(i for i, v in zip(ids, values, strict=True) if len(v) != width * 4)
            raise Unavailable(f"the feature store holds a malformed {entity} row for id {bad!r}")
        matrix = np.frombuffer(joined, dtype=FLOAT).reshape(len(values), width)
        return matrix.copy() if columns is None else matrix[:, columns]

    async def prepare(self, entity: str, version: str, fields: Sequence[str]) -> None:
        """Make ready for ``entity``'s reads before the first request needs one: a connection
        open, the read script cached in Redis, the version's ``fields`` there. Raises
        ``Unavailable`` as a read would; the breaker is not told (no request asked)."""
        keys = [schema_key(entity, version).encode()]
        reply = await self._call(entity, lambda: self._run_read(keys), _PREPARE_S)
        self._layout(entity, version, reply[0], fields)

    async def _run_read(self, keys: list[bytes]) -> Any:
        return await self._script(_READ, self._sha, keys, [VALUE_FIELD])

    async def _script(self, script: str, sha: str, keys: list[bytes], args: list[bytes]) -> Any:
        from redis.exceptions import NoScriptError

        def send(*command: Any) -> Any:
            if self.cluster:  # (the keys share a slot: the entity type's hash tag)
                return on_slot_owner(self.client, keys[0], *command)
            return self.client.execute_command(*command)

        try:
            return await send("EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            # The node has not run it yet (a promoted replica, say): EVAL runs it and keeps it
            # there. Not SCRIPT LOAD, which a cluster client sends to every master, and which
            # fails while one of them is down.
            return await send("EVAL", script, len(keys), *keys, *args)

    def breaker(self, entity: str) -> Breaker:
        """The breaker of ``entity``'s reads."""
        if self._shared is not None:
            return self._shared
        found = self._breakers.get(entity)
        if found is None:
            found = self._breakers[entity] = Breaker(clock=self._clock)
        return found

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
        """Store ``values[i]`` (columns in ``fields`` order) as the features of ``ids[i]``,
        ``chunk`` rows a command (a Lua script). A version's fields are fixed by its first
        write: a later write must bring the same fields (in any order)."""
        check_names(entity, version)
        if len(set(fields)) != len(fields) or not fields:
            raise InvalidInput(f"{entity} fields {list(fields)}: name each field once")
        matrix = np.asarray(values, dtype=FLOAT)
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
                keys = [prefix + _id_bytes(entity_id) for entity_id in part]
                values = [row.tobytes() for row in rows]
                return await self._script(_WRITE, self._write_sha, keys, [VALUE_FIELD, *values])

            await self._call(entity, send, None)
        return len(ids)

    async def drop(self, entity: str, version: str) -> int:
        """Delete one version of an entity's features (SCAN + UNLINK); how many keys."""
        check_names(entity, version)
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
