"""L1: bounds, TTL and grace, the miss kinds, invalidation, and the two policies."""

from __future__ import annotations

import random

import pytest

from tailserve.cache.memory import Lookup, MemoryCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "fifo"])
def test_entries_and_bytes_stay_within_bounds(policy: str) -> None:
    evicted: list[int] = []
    cache = MemoryCache(
        max_entries=50,
        max_bytes=1000,
        policy=policy,  # type: ignore[arg-type]
        clock=Clock(),
        on_evict=evicted.append,
    )
    rng = random.Random(1)
    for i in range(2000):
        cache.put(f"k{rng.randrange(300)}", i, rng.randrange(1, 60), ttl_s=100)
        assert len(cache) <= 50
        assert cache.bytes <= 1000
    assert cache.evictions == len(evicted) > 0


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "fifo"])
def test_ttl_then_grace_then_expired(policy: str) -> None:
    clock = Clock()
    cache = MemoryCache(
        max_entries=10,
        max_bytes=10_000,
        policy=policy,  # type: ignore[arg-type]
        clock=clock,
    )
    cache.put("k", "v", 10, ttl_s=5, grace_s=2)
    clock.now = 4.9
    assert cache.get("k")[0] is Lookup.HIT
    clock.now = 6.0
    state, entry = cache.get("k")
    assert state is Lookup.STALE and entry is not None and entry[0] == "v"
    clock.now = 7.0
    assert cache.get("k") == (Lookup.EXPIRED, None)
    assert "k" not in cache


def test_a_miss_says_cold_or_evicted() -> None:
    cache = MemoryCache(max_entries=2, max_bytes=10_000, policy="lru", clock=Clock())
    assert cache.get("a")[0] is Lookup.COLD
    for key in "abc":
        cache.put(key, key, 1, ttl_s=10)
    assert cache.get("a")[0] is Lookup.EVICTED
    assert cache.get("c")[0] is Lookup.HIT


def test_lru_keeps_what_was_used_recently() -> None:
    cache = MemoryCache(max_entries=2, max_bytes=10_000, policy="lru", clock=Clock())
    cache.put("a", 1, 1, ttl_s=10)
    cache.put("b", 2, 1, ttl_s=10)
    cache.get("a")
    cache.put("c", 3, 1, ttl_s=10)
    assert "a" in cache and "c" in cache and "b" not in cache


def test_a_value_larger_than_the_cache_is_refused() -> None:
    cache = MemoryCache(max_entries=5, max_bytes=100, policy="tinylfu", clock=Clock())
    assert cache.put("big", 0, 101, ttl_s=10) is False
    assert len(cache) == 0


def test_drop_prefix_drops_exactly_the_matching_keys() -> None:
    cache = MemoryCache(max_entries=100, max_bytes=10_000, policy="tinylfu", clock=Clock())
    for key in ("ts:{a}:v1:x", "ts:{a}:v2:y", "ts:{b}:v1:z"):
        cache.put(key, 0, 1, ttl_s=10)
    assert cache.drop_prefix("ts:{a}:v1:") == 1
    assert cache.drop_prefix("ts:{a}:") == 1
    assert "ts:{b}:v1:z" in cache and len(cache) == 1


def _hit_ratio(policy: str, stream: list[int], size: int) -> float:
    cache = MemoryCache(
        max_entries=size,
        max_bytes=10**9,
        policy=policy,  # type: ignore[arg-type]
        clock=Clock(),
    )
    hits = 0
    for item in stream:
        key = str(item)
        if cache.get(key)[0] is Lookup.HIT:
            hits += 1
        else:
            cache.put(key, item, 1, ttl_s=1e9)
    return hits / len(stream)


def test_tinylfu_keeps_popular_keys_through_a_scan_where_lru_loses_them() -> None:
    # A hot set of 50 keys asked for again and again, interleaved with a scan of one-off keys.
    rng = random.Random(7)
    stream = []
    for i in range(20_000):
        stream.append(rng.randrange(50) if i % 2 == 0 else 1_000_000 + i)
    lru = _hit_ratio("lru", stream, 100)
    tinylfu = _hit_ratio("tinylfu", stream, 100)
    assert tinylfu > 0.45  # nearly every hot request hits
    assert tinylfu > lru + 0.1, (tinylfu, lru)


def test_tinylfu_beats_lru_on_a_zipf_stream() -> None:
    rng = np_zipf(20_000, n=10_000, s=1.0)
    lru = _hit_ratio("lru", rng, 500)
    tinylfu = _hit_ratio("tinylfu", rng, 500)
    assert tinylfu > lru, (tinylfu, lru)


def np_zipf(count: int, *, n: int, s: float) -> list[int]:
    import numpy as np

    ranks = np.arange(1, n + 1, dtype=np.float64)
    weights = ranks**-s
    weights /= weights.sum()
    return list(np.random.default_rng(3).choice(n, size=count, p=weights))


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "fifo"])
def test_get_many_answers_what_get_would_and_leaves_the_same_cache(policy: str) -> None:
    # Two caches fed the same stream, one read key by key and the other in batches: every
    # answer, every miss kind and every later eviction must agree.
    def cache(clock: Clock) -> MemoryCache:
        return MemoryCache(
            max_entries=40,
            max_bytes=10_000,
            policy=policy,  # type: ignore[arg-type]
            clock=clock,
        )

    clock = Clock()
    one, many = cache(clock), cache(clock)
    rng = random.Random(4)
    kinds: set[Lookup] = set()
    for step in range(300):
        clock.now = step * 0.1
        key = f"k{rng.randrange(120)}"
        ttl = rng.choice([0.5, 5.0, 50.0])
        one.put(key, step, 1, ttl_s=ttl, grace_s=1.0)
        many.put(key, step, 1, ttl_s=ttl, grace_s=1.0)
        batch = [f"k{rng.randrange(120)}" for _ in range(rng.randrange(1, 12))]
        singles = [one.get(k) for k in batch]
        values, missed, why = many.get_many(batch)
        assert values == [entry[0] if entry is not None else None for _, entry in singles]
        assert missed == [i for i, (_, entry) in enumerate(singles) if entry is None]
        assert why == [lookup for lookup, entry in singles if entry is None]
        kinds.update(why)
        # The same entries, each in the same segment and the same recency order.
        assert one.segments() == many.segments()
    assert kinds == {Lookup.COLD, Lookup.EXPIRED, Lookup.EVICTED}
    assert one.evictions == many.evictions > 0


def test_fifo_evicts_the_oldest_stored_whatever_was_read_since() -> None:
    clock = Clock()
    fifo = MemoryCache(max_entries=3, max_bytes=100, policy="fifo", clock=clock)
    lru = MemoryCache(max_entries=3, max_bytes=100, policy="lru", clock=clock)
    for cache in (fifo, lru):
        for key in "abc":
            cache.put(key, key, 1, ttl_s=10)
        cache.get("a")
        cache.get_many(["a"])
        cache.put("d", "d", 1, ttl_s=10)
    assert "a" not in fifo and "b" in fifo  # the oldest stored went, though just read
    assert "a" in lru and "b" not in lru  # the least recently read went


def test_get_many_on_a_disabled_cache_misses_every_key_cold() -> None:
    cache = MemoryCache(max_entries=10, max_bytes=100, clock=Clock(), enabled=False)
    assert cache.get_many(["a", "b"]) == ([None, None], [0, 1], [Lookup.COLD, Lookup.COLD])
