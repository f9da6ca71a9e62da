"""Full collections on the event loop's schedule: the interpreter's own are off while one
runs, a cycle in the oldest generation is freed by the scheduled one, and the thresholds come
back when the last schedule stops."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from tailserve.process.collector import FullCollections


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _old_cycle() -> weakref.ref[_Node]:
    """A two-object cycle that has reached the oldest generation, no longer referenced."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gc.collect(1)  # survivors of a middle-generation collection move to the oldest
    return weakref.ref(a)


async def test_a_cycle_in_the_oldest_generation_waits_for_the_scheduled_collection() -> None:
    before = gc.get_threshold()
    pauses: asyncio.Queue[float] = asyncio.Queue()
    collections = FullCollections(3600.0, on_pause=pauses.put_nowait)
    collections.start(asyncio.get_running_loop())
    try:
        assert gc.get_threshold()[:2] == before[:2]
        assert gc.get_threshold()[2] > 10**6  # the interpreter starts no full collection
        dead = _old_cycle()
        for _ in range(3):  # young and middle collections leave the oldest generation alone
            gc.collect(1)
        assert dead() is not None
        collections.every_s = 0.01
        collections.stop()
        collections.start(asyncio.get_running_loop())
        pause_s = await asyncio.wait_for(pauses.get(), timeout=10)
        assert dead() is None
        assert pause_s >= 0.0 and collections.collections == 1
        assert collections.last_pause_s == pause_s
    finally:
        collections.stop()
    assert gc.get_threshold() == before


async def test_the_thresholds_come_back_when_the_last_schedule_stops() -> None:
    before = gc.get_threshold()
    loop = asyncio.get_running_loop()
    first, second = FullCollections(3600.0), FullCollections(3600.0)
    first.start(loop)
    second.start(loop)
    first.stop()
    assert gc.get_threshold()[2] > 10**6  # the second still runs its own
    assert second.running and not first.running
    second.stop()
    second.stop()  # a second stop changes nothing
    assert gc.get_threshold() == before


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every_s"):
        FullCollections(0.0)
