"""L1: the in-process result cache, bounded by entries and bytes, with TTL and a grace window.

Two eviction policies for results, chosen per model and compared in benchmarks/cache_tiers.py:

- ``lru``: least recently used goes first.
- ``tinylfu`` (W-TinyLFU, the policy of Caffeine and theine): a small LRU window (1%) takes
  new entries; what falls out of it enters the main space (segmented LRU: probation, then
  protected once hit again) only if it has been asked for more often than the entry it would
  push out, by a count-min sketch of recent popularity that halves itself periodically. One-off
  keys of a Zipf stream then pass through the window without flushing the popular ones.

And, for the feature cache, ``fifo``: the oldest stored goes first, and a hit changes nothing.
Its entries all have one TTL, so the oldest is also the one with the least life left; and a
request there looks up hundreds of ids at random, where LRU's reordering of each (an
OrderedDict's linked list, scattered in memory) cost as much as the lookups themselves.

Written here rather than taken from theine because the bound is in bytes as well as entries
(results differ in size by orders of magnitude: one churn score, a thousand ranker scores) and
because a miss must say why (never seen, expired or evicted) for the recomputation metrics.

Pure: no I/O, no asyncio; the clock is passed in. Not thread-safe (the event loop owns it).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Policy = Literal["lru", "tinylfu", "fifo"]


class Lookup(enum.Enum):
    HIT = "hit"
    STALE = "stale"  # past its TTL, inside the grace window: serve and refresh
    COLD = "cold"  # never seen (or forgotten long ago)
    EXPIRED = "expired"
    EVICTED = "evicted"


# (value, size, fresh until, stale until): a plain tuple, because the collector stops tracking
# a tuple of atomic values (bytes, numbers). A hundred thousand entries of tracked objects made
# every full collection walk them: pauses of tens of ms under load.
Entry = tuple[Any, int, float, float]


_48_BITS = 0xFFFFFFFFFFFF


class FrequencySketch:
    """Count-min sketch of 4 rows of small counters (capped at 15) that halves every
    ``sample`` increments, so popularity is recent popularity."""

    __slots__ = ("_additions", "_mask", "_rows", "_sample")

    def __init__(self, capacity: int) -> None:
        width = 16
        while width < max(capacity, 16):
            width <<= 1
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(4)]
        self._sample = 10 * max(capacity, 16)
        self._additions = 0

    def _slots(self, key: str) -> tuple[int, int, int, int]:
        """The key's counter in each of the four rows, from one hash: rotated and mixed with
        an odd constant a row (written out: a generator's turns cost more than the sums)."""
        h = hash(key)
        mask = self._mask
        return (
            (h ^ (h * 0x9E3779B1)) & _48_BITS & mask,
            ((h >> 16) ^ (h * 0x9E3779B3)) & _48_BITS & mask,
            ((h >> 32) ^ (h * 0x9E3779B5)) & _48_BITS & mask,
            ((h >> 48) ^ (h * 0x9E3779B7)) & _48_BITS & mask,
        )

    def increment(self, key: str) -> None:
        a, b, c, d = self._rows
        i, j, k, m = self._slots(key)
        added = False
        if a[i] < 15:
            a[i] += 1
            added = True
        if b[j] < 15:
            b[j] += 1
            added = True
        if c[k] < 15:
            c[k] += 1
            added = True
        if d[m] < 15:
            d[m] += 1
            added = True
        if added:
            self._additions += 1
            if self._additions >= self._sample:
                self._halve()

    def estimate(self, key: str) -> int:
        a, b, c, d = self._rows
        i, j, k, m = self._slots(key)
        return min(a[i], b[j], c[k], d[m])

    def _halve(self) -> None:
        self._additions //= 2
        for row in self._rows:
            view = np.frombuffer(row, dtype=np.uint8)
            view >>= 1


class _Segment:
    """An LRU list of entries with entry and byte totals."""

    __slots__ = ("bytes", "items")

    def __init__(self) -> None:
        self.items: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0

    def add(self, key: str, entry: Entry) -> None:
        self.items[key] = entry
        self.bytes += entry[1]

    def remove(self, key: str) -> Entry:
        entry = self.items.pop(key)
        self.bytes -= entry[1]
        return entry

    def oldest(self) -> str | None:
        return next(iter(self.items), None)


@dataclass(frozen=True, slots=True)
class Segments:
    """The keys in each of a cache's segments, least recently used first (LRU and FIFO keep
    every entry in ``protected``): how W-TinyLFU has placed what it holds."""

    window: tuple[str, ...]
    probation: tuple[str, ...]
    protected: tuple[str, ...]


class MemoryCache:
    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        policy: Policy = "tinylfu",
        clock: Callable[[], float],
        on_evict: Callable[[int], None] | None = None,
        enabled: bool = True,
    ) -> None:
        # Disabled: holds nothing, every lookup a cold miss (a Redis-only configuration).
        self.enabled = enabled
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a cache needs room for at least one entry and one byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.policy = policy
        self._clock = clock
        self._on_evict = on_evict
        self._window = _Segment()
        self._probation = _Segment()
        self._protected = _Segment()
        self._where: dict[str, _Segment] = {}
        # Recently evicted keys (bounded), so a miss can say it was evicted, not cold.
        self._ghosts: OrderedDict[str, None] = OrderedDict()
        self._sketch = FrequencySketch(max_entries) if policy == "tinylfu" else None
        self.evictions = 0

    # --- reading ----------------------------------------------------------------------------

    def get(self, key: str) -> tuple[Lookup, Entry | None]:
        if not self.enabled:
            return Lookup.COLD, None
        if self._sketch is not None:
            self._sketch.increment(key)
        segment = self._where.get(key)
        if segment is None:
            return (Lookup.EVICTED if key in self._ghosts else Lookup.COLD), None
        entry = segment.items[key]
        now = self._clock()
        if now >= entry[3]:
            self._drop(key)
            return Lookup.EXPIRED, None
        if self.policy != "fifo":
            self._touch(key, segment)
        return (Lookup.HIT if now < entry[2] else Lookup.STALE), entry

    def peek(self, key: str) -> tuple[Lookup, Entry | None]:
        """`get` with no side effect: no popularity counted, no reordering, an expired entry
        left where it is."""
        segment = self._where.get(key) if self.enabled else None
        if segment is None:
            return Lookup.COLD, None
        entry = segment.items[key]
        now = self._clock()
        if now >= entry[3]:
            return Lookup.EXPIRED, entry
        return (Lookup.HIT if now < entry[2] else Lookup.STALE), entry

    def get_many(self, keys: Sequence[str]) -> tuple[list[Any], list[int], list[Lookup]]:
        """`get` for many keys at one reading of the clock: the value of each key where it was
        found (fresh or stale, as `get` finds it; None where not), the positions of the keys
        not found, and the `Lookup` that says why for each of them. For the feature cache, a
        request of which looks up hundreds of ids at once."""
        if not self.enabled:
            return [None] * len(keys), list(range(len(keys))), [Lookup.COLD] * len(keys)
        if self._sketch is not None:  # W-TinyLFU: key by key
            values: list[Any] = []
            missed: list[int] = []
            why: list[Lookup] = []
            for position, key in enumerate(keys):
                lookup, entry = self.get(key)
                values.append(None if entry is None else entry[0])
                if entry is None:
                    missed.append(position)
                    why.append(lookup)
            return values, missed, why
        # LRU and FIFO keep every entry in the protected segment: one lookup a key.
        now = self._clock()
        items, ghosts = self._protected.items, self._ghosts
        recent = items.move_to_end if self.policy == "lru" else None
        values = []
        value = values.append
        missed = []
        why = []
        for position, key in enumerate(keys):
            entry = items.get(key)
            if entry is not None and now < entry[3]:
                if recent is not None:
                    recent(key)
                value(entry[0])
                continue
            value(None)
            missed.append(position)
            if entry is None:
                why.append(Lookup.EVICTED if key in ghosts else Lookup.COLD)
            else:
                self._drop(key)
                why.append(Lookup.EXPIRED)
        return values, missed, why

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    @property
    def bytes(self) -> int:
        return self._window.bytes + self._probation.bytes + self._protected.bytes

    def segments(self) -> Segments:
        return Segments(
            tuple(self._window.items), tuple(self._probation.items), tuple(self._protected.items)
        )

    # --- writing ----------------------------------------------------------------------------

    def now(self) -> float:
        """The time on the cache's clock (the one its entries' times are on)."""
        return self._clock()

    def put(self, key: str, value: Any, size: int, ttl_s: float, grace_s: float = 0.0) -> bool:
        """Store a value for ``ttl_s`` (then stale for ``grace_s``); False when the policy
        turned it away or it is larger than the whole cache."""
        if size > self.max_bytes or not self.enabled:
            return False
        now = self._clock()
        entry = (value, size, now + ttl_s, now + ttl_s + grace_s)
        if key in self._where:
            self._drop(key)
        self._ghosts.pop(key, None)
        if self.policy != "tinylfu":
            self._add(key, entry, self._protected)
            self._evict_lru()
            return key in self._where
        self._add(key, entry, self._window)
        self._evict_tinylfu()
        return key in self._where

    def drop(self, key: str) -> bool:
        if key in self._where:
            self._drop(key)
            return True
        return False

    def drop_prefix(self, prefix: str) -> int:
        """Drop every entry whose key starts with ``prefix`` (invalidation); how many."""
        doomed = [key for key in self._where if key.startswith(prefix)]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def clear(self) -> int:
        count = len(self._where)
        for segment in (self._window, self._probation, self._protected):
            segment.items.clear()
            segment.bytes = 0
        self._where.clear()
        return count

    # --- policy -----------------------------------------------------------------------------

    def _add(self, key: str, entry: Entry, segment: _Segment) -> None:
        segment.add(key, entry)
        self._where[key] = segment

    def _drop(self, key: str) -> Entry:
        return self._where.pop(key).remove(key)

    def _evict(self, key: str) -> None:
        entry = self._drop(key)
        self.evictions += 1
        self._ghosts[key] = None
        if len(self._ghosts) > self.max_entries:
            self._ghosts.popitem(last=False)
        if self._on_evict is not None:
            self._on_evict(entry[1])

    def _touch(self, key: str, segment: _Segment) -> None:
        if segment is self._probation:
            # A second hit promotes to protected (80% of the main space) ...
            entry = segment.remove(key)
            self._add(key, entry, self._protected)
            self._demote()
        else:
            segment.items.move_to_end(key)

    def _demote(self) -> None:
        # ... whose least recent go back to probation when it outgrows its share.
        limit_entries = max(1, int(self.max_entries * 0.99 * 0.8))
        limit_bytes = int(self.max_bytes * 0.99 * 0.8)
        protected = self._protected
        while len(protected.items) > 1 and (
            len(protected.items) > limit_entries or protected.bytes > limit_bytes
        ):
            key = protected.oldest()
            assert key is not None
            entry = protected.remove(key)
            self._add(key, entry, self._probation)
            self._probation.items.move_to_end(key, last=False)

    def _over(self) -> bool:
        return len(self._where) > self.max_entries or self.bytes > self.max_bytes

    def _evict_lru(self) -> None:
        while self._over():
            key = self._protected.oldest()
            assert key is not None
            self._evict(key)

    def _evict_tinylfu(self) -> None:
        window = self._window
        window_entries = max(1, self.max_entries // 100)
        window_bytes = max(1, self.max_bytes // 100)
        # What outgrows the window becomes a candidate for the main space.
        while len(window.items) > 1 and (
            len(window.items) > window_entries or window.bytes > window_bytes
        ):
            key = window.oldest()
            assert key is not None
            entry = window.remove(key)
            self._add(key, entry, self._probation)
            self._admit(key)
        while self._over():
            # Only the window is left over the bound (one entry larger than its share).
            victim = self._probation.oldest() or self._protected.oldest() or window.oldest()
            assert victim is not None
            self._evict(victim)

    def _admit(self, candidate: str) -> None:
        """The candidate (just put last in probation) stays only if it is more popular than
        each victim it must push out; otherwise it goes itself."""
        assert self._sketch is not None
        wanted = self._sketch.estimate(candidate)
        while self._over():
            victim = self._probation.oldest()
            if victim == candidate:
                victim = self._protected.oldest()
            if victim is None or victim == candidate:
                break
            if self._sketch.estimate(victim) >= wanted:
                self._evict(candidate)
                return
            self._evict(victim)
