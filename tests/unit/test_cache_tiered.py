"""The tiered cache's request path without Redis: single flight, stale-while-revalidate,
bypass and refresh, invalidation racing a computation."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from tailserve.cache.inprocess import InProcessStore, InProcessTier
from tailserve.cache.keys import KeyBuilder
from tailserve.cache.memory import MemoryCache
from tailserve.cache.redis import INVALIDATION_CHANNEL
from tailserve.cache.tiered import CachePolicy, ModelView, ResultCache
from tailserve.errors import DeadlineUnmeetable


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Model:
    """A computation that counts its runs and can be held until released."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self) -> tuple[dict[str, Any], str]:
        self.runs += 1
        await self.release.wait()
        return {"y": np.array([float(self.runs)], dtype=np.float32)}, f"run{self.runs}"


def view(clock: Clock, policy: CachePolicy | None = None) -> ModelView:
    l1 = MemoryCache(max_entries=100, max_bytes=100_000, clock=clock)
    keys = KeyBuilder("m", 1, "schema")
    return ModelView("m", 1, keys, l1, policy or CachePolicy(l1_ttl_s=10, l2_ttl_s=10))


async def test_a_miss_computes_and_the_next_request_hits_l1() -> None:
    cache, model, v = ResultCache(worker_id="w1"), Model(), view(Clock())
    first = await cache.serve(v, "k", "use", model)
    second = await cache.serve(v, "k", "use", model)
    assert (first.source, second.source) == ("miss", "l1")
    assert first.extra == "run1" and second.extra is None
    assert second.outputs["y"].tolist() == [1.0] and model.runs == 1
    assert second.lineage is not None and second.lineage.computed_by == "w1"


async def test_identical_concurrent_requests_run_the_model_once() -> None:
    cache, model, v = ResultCache(), Model(), view(Clock())
    model.release.clear()
    requests = [asyncio.ensure_future(cache.serve(v, "k", "use", model)) for _ in range(100)]
    await asyncio.sleep(0)
    model.release.set()
    answers = await asyncio.gather(*requests)
    assert model.runs == 1
    sources = [a.source for a in answers]
    assert sources.count("miss") == 1 and sources.count("coalesced") == 99
    assert all(a.outputs["y"].tolist() == [1.0] for a in answers)


async def test_followers_compute_themselves_when_the_leader_is_cancelled() -> None:
    cache, model, v = ResultCache(), Model(), view(Clock())
    model.release.clear()
    leader = asyncio.ensure_future(cache.serve(v, "k", "use", model))
    await asyncio.sleep(0)
    follower = asyncio.ensure_future(cache.serve(v, "k", "use", model))
    await asyncio.sleep(0)
    leader.cancel()
    await asyncio.sleep(0)
    model.release.set()
    answer = await follower
    assert answer.source == "miss" and model.runs == 2


async def test_the_leaders_own_refusal_does_not_reach_its_followers() -> None:
    # The leading request's deadline cannot be met (its own, tight): the scheduler refuses
    # it. Its followers have time: the first of them computes, the rest follow that one.
    cache, model, v = ResultCache(), Model(), view(Clock())
    model.release.clear()
    gate = asyncio.Event()

    async def refused() -> tuple[dict[str, Any], None]:
        await gate.wait()
        raise DeadlineUnmeetable("the deadline cannot be met")

    leader = asyncio.ensure_future(cache.serve(v, "k", "use", refused))
    await asyncio.sleep(0)
    followers = [asyncio.ensure_future(cache.serve(v, "k", "use", model)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(DeadlineUnmeetable):
        await leader
    for _ in range(5):
        await asyncio.sleep(0)
    model.release.set()
    answers = await asyncio.gather(*followers)
    assert model.runs == 1
    assert sorted(a.source for a in answers) == ["coalesced"] * 4 + ["miss"]
    assert all(a.outputs["y"].tolist() == [1.0] for a in answers)


async def test_an_error_reaches_every_follower_and_is_not_cached() -> None:
    cache, v = ResultCache(), view(Clock())
    gate = asyncio.Event()

    async def failing() -> tuple[dict[str, Any], None]:
        await gate.wait()
        raise ValueError("model failed")

    tasks = [asyncio.ensure_future(cache.serve(v, "k", "use", failing)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)
    model = Model()
    assert (await cache.serve(v, "k", "use", model)).source == "miss"


async def test_stale_is_served_and_refreshed_once_in_the_background() -> None:
    clock = Clock()
    cache, model = ResultCache(), Model()
    v = view(clock, CachePolicy(l1_ttl_s=5, l2_ttl_s=5, grace_s=10))
    await cache.serve(v, "k", "use", model)
    clock.now = 6.0
    model.release.clear()
    stale = [await cache.serve(v, "k", "use", model) for _ in range(5)]
    assert [s.source for s in stale] == ["stale"] * 5
    assert all(s.outputs["y"].tolist() == [1.0] for s in stale)
    model.release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert model.runs == 2  # one refresh for five stale reads
    fresh = await cache.serve(v, "k", "use", model)
    assert fresh.source == "l1" and fresh.outputs["y"].tolist() == [2.0]


async def test_bypass_neither_reads_nor_writes_and_refresh_writes() -> None:
    cache, model, v = ResultCache(), Model(), view(Clock())
    assert (await cache.serve(v, "k", "use", model)).source == "miss"
    bypass = await cache.serve(v, "k", "bypass", model)
    assert bypass.source == "bypass" and bypass.outputs["y"].tolist() == [2.0]
    assert (await cache.serve(v, "k", "use", model)).outputs["y"].tolist() == [1.0]
    refreshed = await cache.serve(v, "k", "refresh", model)
    assert refreshed.source == "refresh" and refreshed.outputs["y"].tolist() == [3.0]
    after = await cache.serve(v, "k", "use", model)
    assert after.source == "l1" and after.outputs["y"].tolist() == [3.0]


async def test_a_result_computed_across_an_invalidation_is_not_stored() -> None:
    cache, model, v = ResultCache(), Model(), view(Clock())
    model.release.clear()
    running = asyncio.ensure_future(cache.serve(v, "ts:{m}:v1:k", "use", model))
    await asyncio.sleep(0)
    report = await cache.invalidate("ts:{m}:")
    assert report == {"l1": 0, "l2": 0, "published": False}
    model.release.set()
    assert (await running).source == "miss"
    assert (await cache.serve(v, "ts:{m}:v1:k", "use", model)).source == "miss"


@pytest.mark.parametrize(("prefix", "stored"), [("ts:{other}:", True), ("ts:", False)])
async def test_invalidating_another_model_keeps_what_this_one_computes(
    prefix: str, stored: bool
) -> None:
    # Another model's invalidation says nothing of m's result; one of every model does.
    cache, model, v = ResultCache(), Model(), view(Clock())
    model.release.clear()
    running = asyncio.ensure_future(cache.serve(v, "ts:{m}:v1:k", "use", model))
    await asyncio.sleep(0)
    await cache.invalidate(prefix)
    model.release.set()
    assert (await running).source == "miss"
    again = await cache.serve(v, "ts:{m}:v1:k", "use", model)
    assert again.source == ("l1" if stored else "miss")


async def test_invalidation_by_prefix_drops_only_matching_entries() -> None:
    cache, model, v = ResultCache(), Model(), view(Clock())
    cache.l1_for("m", lambda: v.l1)
    for key in ("ts:{m}:v1:a", "ts:{m}:v2:b"):
        await cache.serve(v, key, "use", model)
    report = await cache.invalidate("ts:{m}:v1:")
    assert report["l1"] == 1
    assert (await cache.serve(v, "ts:{m}:v2:b", "use", model)).source == "l1"
    assert (await cache.serve(v, "ts:{m}:v1:a", "use", model)).source == "miss"


@pytest.mark.parametrize("evict", [False, True])
async def test_recomputations_are_told_apart_from_first_computations(evict: bool) -> None:
    seen: list[bool] = []

    class Observer:
        def on_lookup(self, model: str, tier: str, result: str) -> None: ...
        def on_coalesced(self, model: str) -> None: ...
        def on_evict(self, model: str, size: int) -> None: ...
        def on_compute(self, model: str, recompute: bool) -> None:
            seen.append(recompute)

    clock = Clock()
    cache, model, v = ResultCache(observer=Observer()), Model(), view(clock)
    await cache.serve(v, "k", "use", model)
    if evict:
        v.l1.max_entries = 1
        await cache.serve(v, "other", "use", model)
    else:
        clock.now = 100.0
    await cache.serve(v, "k", "use", model)
    assert seen[0] is False and seen[-1] is True


async def test_an_invalidation_is_published_even_when_l2_could_not_be_cleared() -> None:
    # (The shared tier's other behaviour, against Redis and this twin alike:
    # integration/test_cache_l2.py.)
    store = InProcessStore()
    cache = ResultCache(redis=InProcessTier(store), worker_id="w1")
    heard = store.subscribe(INVALIDATION_CHANNEL)
    v = view(Clock())
    await cache.serve(v, "ts:{m}:v1:k", "use", Model())  # its write still waits to go out
    store.fail("SCAN")
    report = await cache.invalidate("ts:{m}:")
    assert report == {"l1": 0, "l2": 0, "published": True}
    assert orjson.loads(heard.get_nowait()) == {"prefix": "ts:{m}:", "origin": "w1"}
    # And this worker's writes not yet sent under the prefix are dropped.
    await cache.flush()
    assert len(store) == 0
    await cache.close()


class Pressure:
    """The model's load as the cache asks for it: overloaded or not, and how often asked."""

    def __init__(self, overloaded: bool) -> None:
        self.overloaded = overloaded
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.overloaded


async def test_past_the_grace_window_an_overloaded_model_serves_stale_not_computes() -> None:
    clock = Clock()
    cache, model = ResultCache(), Model()
    v = view(clock, CachePolicy(l1_ttl_s=5, l2_ttl_s=5, grace_s=2, overload_s=60))
    await cache.serve(v, "k", "use", model)
    pressure = Pressure(overloaded=True)
    clock.now = 6.0  # within the grace window: stale and refreshed, load or no load
    model.release.clear()
    assert (await cache.serve(v, "k", "use", model, pressure)).source == "stale"
    assert pressure.asked == 0
    model.release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert model.runs == 2
    clock.now = 6.0 + 5 + 30  # 30 s past its (refreshed) TTL: past grace, within overload_s
    answer = await cache.serve(v, "k", "use", model, pressure)
    assert (answer.source, answer.outputs["y"].tolist(), model.runs) == ("stale", [2.0], 2)
    for _ in range(10):
        await asyncio.sleep(0)
    assert model.runs == 2  # not refreshed either: the model has no time for it
    pressure.overloaded = False
    quiet = await cache.serve(v, "k", "use", model, pressure)
    assert (quiet.source, quiet.outputs["y"].tolist(), model.runs) == ("miss", [3.0], 3)


async def test_past_the_overload_bound_a_value_is_computed_even_under_overload() -> None:
    clock = Clock()
    cache, model = ResultCache(), Model()
    v = view(clock, CachePolicy(l1_ttl_s=5, l2_ttl_s=5, overload_s=10))
    await cache.serve(v, "k", "use", model)
    clock.now = 5 + 11
    answer = await cache.serve(v, "k", "use", model, Pressure(overloaded=True))
    assert (answer.source, model.runs) == ("miss", 2)


async def test_an_overloaded_model_serves_a_stale_value_from_l2() -> None:
    # Another worker's value in the shared tier, past its TTL (wall clock) and grace.
    wall = Clock()
    store = InProcessStore()
    writer = ResultCache(redis=InProcessTier(store), worker_id="w1", wall_clock=wall)
    policy = CachePolicy(l1_ttl_s=5, l2_ttl_s=5, grace_s=1, overload_s=60)
    await writer.serve(view(Clock(), policy), "k", "use", Model())
    await writer.flush()
    wall.now = 30.0
    reader = ResultCache(redis=InProcessTier(store), worker_id="w2", wall_clock=wall)
    model = Model()
    answer = await reader.serve(view(Clock(), policy), "k", "use", model, Pressure(True))
    assert (answer.source, answer.outputs["y"].tolist(), model.runs) == ("stale", [1.0], 0)
    computed = await reader.serve(view(Clock(), policy), "k", "use", model, Pressure(False))
    assert (computed.source, model.runs) == ("miss", 1)
    await writer.close()
    await reader.close()
