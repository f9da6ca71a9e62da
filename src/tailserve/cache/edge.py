"""The edge tier: a client's own cache of the answers of hot keys, in the caller's process.

A hit here costs no connection, no worker and no encoding: the client answers from memory.
What keeps it honest is a short TTL and the workers' own invalidations, which the client
follows on the Redis channel (``cache/invalidations.py``) and applies here by prefix.

Keys have the workers' shape, ``ts:{model}:v<version>:<digest>``, so the prefixes a worker
invalidates (``ts:{m}:``, ``ts:{m}:v2:``) match the edge's keys of that model or version. The
digest cannot be the worker's: that one hashes the model's input schema, feature version and
key rule from model.yaml, which a client does not have. It covers instead what the client
sends: each input sorted by name (datatype, shape, canonical data, as `KeyBuilder` frames
them), the outputs asked for, and every request parameter but those that never change an
answer. A worker's prefix naming one key or digest range is taken as its whole version.

The version is the one a request names, else the last one the workers answered an unpinned
request of that model with: a new version changes every key as soon as one reply shows it.

Pure: no I/O, no asyncio; the clock is the config's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
import orjson

from tailserve.cache.keys import PREFIX, KeyBuilder, KeyRule, model_prefix, version_prefix
from tailserve.cache.memory import Lookup, MemoryCache, Policy
from tailserve.tensors import Tensor, datatype_of

# Request parameters that never change an answer: the worker's cache mode, deadline and
# priority, and how the reply is encoded.
IGNORED_PARAMETERS = frozenset({"cache", "timeout", "priority", "binary_data_output"})
# ``parameters.cache`` of a worker's reply when the model's own cache is on.
WORKER_SOURCES = frozenset(
    {"l1", "l2", "miss", "coalesced", "precomputed", "refresh", "stale", "bypass"}
)
# Replies not kept: past their TTL at the worker, or asked not to be cached.
_NOT_KEPT = frozenset({"stale", "bypass"})
# The request's parameters and outputs, hashed as one pseudo-parameter of the key rule.
_EXTRA = "request"
_ENTRY_OVERHEAD = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeCache:
    """How a `Client` keeps answers in its own process.

    ``models``: the models cached at the edge whatever their workers do; with
    ``follow_workers`` also each model whose replies come from a worker's cache (its
    model.yaml turned the cache on, so its answers are fit to share). ``redis_url``: the
    workers' Redis, whose invalidation channel the client follows; without one, only the TTL
    bounds how long an answer outlives an invalidation. ``coalesce``: identical requests in
    flight at once from this process go to a worker once.
    """

    ttl_s: float = 1.0
    max_entries: int = 10_000
    max_bytes: int = 16 * 2**20
    policy: Policy = "tinylfu"
    models: Collection[str] = frozenset()
    follow_workers: bool = True
    redis_url: str | None = None
    coalesce: bool = True
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.models, str):
            raise ValueError("EdgeCache(models=...) takes a collection of model names")
        object.__setattr__(self, "models", frozenset(self.models))
        if not self.ttl_s > 0:
            raise ValueError(f"EdgeCache ttl_s must be > 0, got {self.ttl_s!r}")
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError("EdgeCache needs room for at least one entry and one byte")
        if self.policy not in get_args(Policy):
            raise ValueError(f"EdgeCache policy must be one of {get_args(Policy)}")


@dataclass(frozen=True, slots=True)
class Kept:
    """One answer as the edge keeps it: the reply's parts, never handed out themselves."""

    outputs: Mapping[str, np.ndarray[Any, Any]]
    replica: str | None
    parameters: Mapping[str, Any]
    headers: Mapping[str, str]


class EdgeStore:
    """The edge tier's entries and accounts. Counters: ``hits``, ``misses`` (lookups of a
    cached model that found nothing fresh), ``coalesced`` (requests that shared another's
    reply, counted by the client), ``stores``, ``invalidations`` (prefixes applied, from the
    channel or the caller), ``dropped`` (entries they removed), ``resets`` (everything dropped
    because invalidations may have been missed)."""

    def __init__(self, config: EdgeCache) -> None:
        self.config = config
        self._memory = MemoryCache(
            max_entries=config.max_entries,
            max_bytes=config.max_bytes,
            policy=config.policy,
            clock=config.clock,
        )
        self._cached: set[str] = set(config.models)
        self._versions: dict[str, str] = {}
        self._digests: dict[str, KeyBuilder] = {}
        # Bumped by an invalidation: a reply to a request sent before one is not kept.
        self._generation = 0
        self._model_generations: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self.coalesced = 0
        self.stores = 0
        self.invalidations = 0
        self.dropped = 0
        self.resets = 0

    def __len__(self) -> int:
        return len(self._memory)

    @property
    def bytes(self) -> int:
        return self._memory.bytes

    @property
    def evictions(self) -> int:
        return self._memory.evictions

    def caches(self, model: str) -> bool:
        """Whether ``model``'s answers are kept here (named, or learnt from its replies)."""
        return model in self._cached

    # --- keys -------------------------------------------------------------------------------

    def digest(
        self,
        model: str,
        inputs: Mapping[str, Any],
        outputs: Sequence[str] | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> str | None:
        """The version-free part of the request's key; None for a request the edge cannot
        key faithfully (an object input holding more than text and bytes, parameters that
        are not JSON)."""
        tensors = []
        for name, value in inputs.items():
            array = np.asarray(value)
            if array.dtype.kind == "O" and not all(
                isinstance(item, str | bytes) for item in array.reshape(-1).tolist()
            ):
                return None
            tensors.append(Tensor(name, datatype_of(array), array))
        kept = {k: v for k, v in (parameters or {}).items() if k not in IGNORED_PARAMETERS}
        try:
            extra = orjson.dumps(
                [kept, None if outputs is None else list(outputs)],
                option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY,
            )
        except TypeError:
            return None
        builder = self._digests.get(model)
        if builder is None:
            builder = self._digests[model] = KeyBuilder(
                model, 0, "edge", rule=KeyRule(parameters=(_EXTRA,))
            )
        key = builder.key(tensors, {_EXTRA: extra})
        return key[len(builder.prefix) :]

    def key(self, model: str, version: str | int | None, digest: str) -> str | None:
        """The key of a request for ``version`` (None: the one the workers serve now, as
        last seen); None while that is not known."""
        if version is None:
            known = self._versions.get(model)
            if known is None:
                return None
            return version_prefix(model, known) + digest
        return version_prefix(model, version) + digest

    # --- reading and writing ----------------------------------------------------------------

    def lookup(self, key: str | None) -> Kept | None:
        """The fresh answer kept under ``key`` (None, a key not known yet: a miss)."""
        if key is not None:
            lookup, entry = self._memory.get(key)
            if lookup is Lookup.HIT and entry is not None:
                self.hits += 1
                found: Kept = entry[0]
                return found
        self.misses += 1
        return None

    def stamp(self, model: str) -> tuple[int, int]:
        """Taken before a request goes out; `keep` refuses its reply if an invalidation of
        its model passed since."""
        return self._generation, self._model_generations.get(model, 0)

    def learn(self, model: str, parameters: Mapping[str, Any], *, pinned: bool) -> bool:
        """Read a worker's reply to a request of ``model`` (``pinned``: one that named its
        version): the version it serves now, and whether its answers are cacheable."""
        version = parameters.get("model_version")
        if not pinned and version is not None and _whole(str(version)):
            self._versions[model] = str(version)
        if self.config.follow_workers and parameters.get("cache") in WORKER_SOURCES:
            self._cached.add(model)
        return model in self._cached

    def keep(self, model: str, digest: str, kept: Kept, stamp: tuple[int, int]) -> bool:
        """Store a reply of ``model`` under the version that answered it."""
        version = kept.parameters.get("model_version")
        if (
            model not in self._cached
            or version is None
            or not _whole(str(version))
            or kept.parameters.get("cache") in _NOT_KEPT
            or stamp != self.stamp(model)
        ):
            return False
        size = _ENTRY_OVERHEAD + sum(_size(array) for array in kept.outputs.values())
        stored = self._memory.put(
            version_prefix(model, str(version)) + digest, kept, size, self.config.ttl_s
        )
        self.stores += stored
        return stored

    # --- invalidation -----------------------------------------------------------------------

    def invalidate(self, prefix: str) -> int:
        """Drop what a worker's invalidation of ``prefix`` drops; how many entries."""
        model = model_of(prefix)
        if model is None:
            self._generation += 1
        else:
            self._model_generations[model] = self._model_generations.get(model, 0) + 1
        dropped = self._memory.drop_prefix(edge_prefix(prefix))
        self.invalidations += 1
        self.dropped += dropped
        return dropped

    def clear(self) -> int:
        """Drop everything: invalidations may have been missed."""
        self._generation += 1
        self.resets += 1
        dropped = self._memory.clear()
        self.dropped += dropped
        return dropped

    def counters(self) -> dict[str, int]:
        return {
            "entries": len(self),
            "bytes": self.bytes,
            "hits": self.hits,
            "misses": self.misses,
            "coalesced": self.coalesced,
            "stores": self.stores,
            "evictions": self.evictions,
            "invalidations": self.invalidations,
            "dropped": self.dropped,
            "resets": self.resets,
        }


def prefix_for(model: str | None = None, version: str | int | None = None) -> str:
    """The key prefix of a model (and version), as a worker's invalidation names it."""
    if model is None:
        if version is not None:
            raise ValueError("a version is a version of a model: name the model too")
        return f"{PREFIX}:"
    return model_prefix(model) if version is None else version_prefix(model, version)


def model_of(prefix: str) -> str | None:
    """The model a key prefix is within (``ts:{model}:...``), or None for a wider one."""
    head = f"{PREFIX}:{{"
    if not prefix.startswith(head):
        return None
    end = prefix.find("}", len(head))
    return prefix[len(head) : end] if end > 0 else None


def edge_prefix(prefix: str) -> str:
    """The edge's prefix for a worker's: the same up to the version; one naming part of a
    version's digests (the edge's differ from the workers') widened to that version."""
    model = model_of(prefix)
    if model is None:
        return prefix
    head = model_prefix(model)
    version, colon, digest = prefix[len(head) :].partition(":")
    return head + version + colon if colon and digest else prefix


def _whole(version: str) -> bool:
    return version.isdigit()


def _size(array: np.ndarray[Any, Any]) -> int:
    if array.dtype.kind == "O":
        return sum(len(item) for item in array.reshape(-1).tolist() if hasattr(item, "__len__"))
    return int(array.nbytes)
