"""The catalogue under a memory budget (`repository.manager`), in process: a fake builder whose
builds take a set time on a fake clock and add a set amount of memory, so which model loads,
waits, is refused or unloads is decided by the budget alone."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.models import doubler_config, write_model
from tailserve.errors import DeadlineExceeded, ModelLoadError, ModelNotReady
from tailserve.modelconfig import ModelConfig
from tailserve.repository.footprint import Memory
from tailserve.repository.manager import COLD_REASON, ModelManager, ModelStatus

MIB = 2**20
LOAD_S = 0.2  # what every build takes on the fake clock


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeBuilder:
    """Each build advances the clock by LOAD_S and holds MIB of memory until it is retired;
    a gate (per model) lets a test hold a build back."""

    clock: Clock
    held: int = 0
    builds: Counter[str] = field(default_factory=Counter)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)

    async def build(self, config: ModelConfig, version: int, version_dir: Path) -> Any:
        gate = self.gates.get(config.name)
        if gate is not None:
            await gate.wait()
        self.clock.now += LOAD_S
        self.builds[config.name] += 1
        self.held += MIB
        return (config.name, version, self.builds[config.name])

    async def retire(self, served: Any) -> None:
        self.held -= MIB

    def close(self) -> None:
        pass

    def memory(self) -> Memory:
        return Memory(resident=self.held, allocated=self.held)


@dataclass
class Observer:
    loads: list[str] = field(default_factory=list)
    unloads: list[tuple[str, str]] = field(default_factory=list)
    cold: Counter[tuple[str, str]] = field(default_factory=Counter)

    def on_model_load(self, model: str, seconds: float) -> None:
        self.loads.append(model)

    def on_model_unload(self, model: str, seconds: float, reason: str) -> None:
        self.unloads.append((model, reason))

    def on_cold_request(self, model: str, outcome: str) -> None:
        self.cold[(model, outcome)] += 1


def repository(root: Path, names: str = "abc", pad: int = MIB) -> Path:
    """Models of about ``pad`` bytes of artifacts each (the estimate before a load)."""
    for name in names:
        folder = write_model(root, name, doubler_config())
        (folder / "1" / "pad.bin").write_bytes(b"\0" * pad)
    return root


@dataclass
class Fixture:
    manager: ModelManager[Any]
    builder: FakeBuilder
    clock: Clock
    observer: Observer

    def within(self, seconds: float) -> Any:
        """A request's deadline ``seconds`` from now."""
        at = self.clock.now + seconds
        return lambda config: at

    def loaded(self) -> set[str]:
        return {state.name for state in self.manager.states() if state.versions}


def budgeted(root: Path, *, holds: float = 2.5, pinned: tuple[str, ...] = ()) -> Fixture:
    clock = Clock()
    builder = FakeBuilder(clock)
    observer = Observer()
    manager: ModelManager[Any] = ModelManager(
        root,
        builder,
        budget_bytes=int(holds * (MIB + 1024)),
        pinned=pinned,
        observer=observer,
        clock=clock,
        memory=builder.memory,
    )
    return Fixture(manager, builder, clock, observer)


async def test_at_start_only_what_fits_loads_and_the_rest_is_cold(tmp_path: Path) -> None:
    f = budgeted(repository(tmp_path))
    assert await f.manager.load_all() == []
    assert f.loaded() == {"a", "b"}
    c = f.manager.state("c")
    assert c.cold and c.status is ModelStatus.UNAVAILABLE and "memory budget" in c.reason
    assert f.manager.peek("c") is None  # (the data plane's shed leaves it to acquire)
    with pytest.raises(ModelNotReady, match="memory budget"):
        f.manager.get("c")


async def test_a_cold_model_loads_on_demand_and_the_least_recently_used_unloads(
    tmp_path: Path,
) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()
    f.clock.now += 1
    await f.manager.acquire("a", None, f.within(1))  # a used: b is the least recent now
    served = await f.manager.acquire("c", None, f.within(5))
    assert served[0] == "c"
    assert f.loaded() == {"a", "c"}
    assert f.observer.unloads == [("b", "budget")]
    b = f.manager.state("b")
    assert b.cold and b.reason == COLD_REASON
    assert f.manager.residency.held() <= f.manager.residency.budget
    assert f.builder.held == 2 * MIB  # what the process holds follows
    assert f.observer.cold[("c", "waited")] == 1


async def test_a_load_that_would_end_past_the_deadline_is_refused_but_goes_on(
    tmp_path: Path,
) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()  # two loads measured: LOAD_S each
    with pytest.raises(ModelNotReady, match=r"'c' is not loaded on this worker") as refused:
        await f.manager.acquire("c", None, f.within(LOAD_S / 2))
    assert "past this request's deadline" in refused.value.message
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    assert f.observer.cold[("c", "refused")] == 1
    # The load the refused request asked for goes on: the next request finds c loaded.
    for _ in range(100):
        if "c" in f.loaded():
            break
        await asyncio.sleep(0.01)
    assert f.manager.get("c")[0] == "c"


async def test_concurrent_requests_for_a_cold_model_share_one_load(tmp_path: Path) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()
    gate = f.builder.gates["c"] = asyncio.Event()
    waiting = [asyncio.create_task(f.manager.acquire("c", None, f.within(5))) for _ in range(8)]
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in waiting)
    gate.set()
    served = await asyncio.gather(*waiting)
    assert f.builder.builds["c"] == 1
    assert {s for s in served} == {("c", 1, 1)}
    assert f.observer.cold[("c", "waited")] == 8


async def test_a_load_that_outlasts_the_deadline_answers_deadline_exceeded(
    tmp_path: Path,
) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()
    gate = f.builder.gates["c"] = asyncio.Event()  # held back past the deadline
    # Expected in LOAD_S (the others' loads), so the request waits; its 0.3 s run out first.
    with pytest.raises(DeadlineExceeded, match="'c' was still loading"):
        await f.manager.acquire("c", None, f.within(0.3))
    assert f.observer.cold[("c", "late")] == 1
    gate.set()


async def test_a_model_larger_than_the_budget_is_refused_with_its_size(tmp_path: Path) -> None:
    root = repository(tmp_path)
    big = write_model(root, "big", doubler_config())
    (big / "1" / "pad.bin").write_bytes(b"\0" * (3 * MIB))
    f = budgeted(root)
    await f.manager.load_all()
    assert "big" not in f.loaded()
    with pytest.raises(ModelNotReady, match=r"'big' needs 3\.0 MiB, more than"):
        await f.manager.acquire("big", None, f.within(5))
    assert f.loaded() == {"a", "b"}  # nothing was unloaded for it
    with pytest.raises(ModelLoadError):
        await f.manager.load("big")


async def test_a_model_unloaded_by_request_is_not_loaded_on_demand(tmp_path: Path) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()
    await f.manager.unload("a")
    assert not f.manager.state("a").cold
    with pytest.raises(ModelNotReady, match="'a' is not ready"):
        await f.manager.acquire("a", None, f.within(5))
    assert f.builder.builds["a"] == 1


async def test_pinned_models_never_unload(tmp_path: Path) -> None:
    f = budgeted(repository(tmp_path, "abcd"), pinned=("c",))
    await f.manager.load_all()
    assert f.loaded() == {"c", "a"}  # c first (pinned), then a
    for name in ("b", "d", "a", "b"):
        f.clock.now += 1
        await f.manager.acquire(name, None, f.within(5))
        assert "c" in f.loaded() and len(f.loaded()) == 2


async def test_room_freed_is_filled_with_the_cold_model_most_asked_for(tmp_path: Path) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()
    for name in ("a", "b", "c"):  # a, the least recently used, unloads for c
        f.clock.now += 1
        await f.manager.acquire(name, None, f.within(5))
    assert f.loaded() == {"b", "c"}
    await f.manager.unload("b")  # room for one: a, asked for lately, loads before its request
    for _ in range(100):
        if "a" in f.loaded():
            break
        await asyncio.sleep(0.01)
    assert f.loaded() == {"a", "c"}
    assert f.builder.builds["a"] == 2


async def test_loads_and_unloads_are_told_to_the_observer(tmp_path: Path) -> None:
    f = budgeted(repository(tmp_path))
    await f.manager.load_all()
    await f.manager.acquire("c", None, f.within(5))
    assert f.observer.loads == ["a", "b", "c"]
    assert f.observer.unloads == [("a", "budget")]
    assert f.manager.residency.resident() == {
        "b": f.manager.residency.cost("b"),
        "c": f.manager.residency.cost("c"),
    }


async def test_without_a_budget_every_model_loads_and_acquire_is_get(tmp_path: Path) -> None:
    clock = Clock()
    builder = FakeBuilder(clock)
    manager: ModelManager[Any] = ModelManager(
        repository(tmp_path, "abcd"), builder, clock=clock, memory=builder.memory
    )
    await manager.load_all()
    assert {s.name for s in manager.states() if s.versions} == {"a", "b", "c", "d"}
    assert await manager.acquire("d", None, lambda config: 0.0) == manager.get("d")
    # What each build added is measured even so (the metrics show it).
    assert manager.residency.cost("a") >= MIB
