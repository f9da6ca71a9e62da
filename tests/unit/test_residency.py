"""The memory budget's policy (`repository.residency`): which models load at start, which unload
for another, how long a load is expected to take and which model loads ahead of demand, on a
fake clock."""

from __future__ import annotations

import pytest

from tailserve.errors import ConfigError
from tailserve.repository.residency import DEFAULT_LOAD_S, Residency

MIB = 2**20


def budget_of(models: int, *, each: int = 10 * MIB, names: str = "abcdefgh") -> Residency:
    """A budget that holds ``models`` models of ``each`` bytes (and half of another)."""
    residency = Residency(models * each + each // 2)
    for name in names:
        residency.know(name, each)
    return residency


def load(residency: Residency, name: str, now: float, *, seconds: float = 0.1) -> None:
    residency.loaded(name, now, seconds=seconds, measured_bytes=0)


def test_at_start_the_models_that_fit_load_in_order_and_the_pinned_first() -> None:
    residency = Residency(25 * MIB, pinned=["e"])
    for name, size in {"a": 10, "b": 20, "c": 5, "d": 10, "e": 10}.items():
        residency.know(name, size * MIB)
    # e (pinned) first; then a fits, b does not, c does, d does not.
    assert residency.initial(["a", "b", "c", "d", "e"]) == ["e", "a", "c"]
    assert Residency(0).initial(["a", "b"]) == ["a", "b"]  # no budget: everything


def test_the_least_recently_used_model_unloads_when_another_needs_room() -> None:
    residency = budget_of(5)
    for at, name in enumerate("abcde"):
        load(residency, name, float(at))
    assert residency.fits("a") and not residency.fits("f")
    residency.used("a", 10.0)  # a is used again: b is now the least recently used
    residency.used("c", 11.0)
    assert residency.victims("f", 12.0) == ["b"]
    residency.unloaded("b")
    load(residency, "f", 12.0)
    assert set(residency.resident()) == {"a", "c", "d", "e", "f"}
    assert residency.held() <= residency.budget
    # The model just loaded counts as used: the next one out is d, not f.
    assert residency.victims("g", 13.0) == ["d"]


def test_as_many_unload_as_a_larger_model_needs_and_pinned_ones_never() -> None:
    residency = Residency(50 * MIB, pinned=["a"])
    for name in "abcd":
        residency.know(name, 10 * MIB)
    residency.know("big", 35 * MIB)
    for at, name in enumerate("abcd"):
        load(residency, name, float(at))
    # 40 MiB held, 10 free: 25 more are needed, so b, c and d go (a is pinned).
    assert residency.victims("big", 5.0) == ["b", "c", "d"]
    residency.know("huge", 45 * MIB)  # with a pinned (10), 45 can never fit 50
    assert residency.victims("huge", 5.0) is None


def test_a_measured_size_replaces_the_estimate_when_larger() -> None:
    residency = budget_of(2)
    residency.loaded("a", 0.0, seconds=0.1, measured_bytes=4 * MIB)  # less than its files
    assert residency.cost("a") == 10 * MIB
    residency.loaded("a", 1.0, seconds=0.1, measured_bytes=18 * MIB)
    assert residency.cost("a") == 18 * MIB and residency.measured("a")
    load(residency, "b", 2.0)
    # 28 MiB held in a 25 MiB budget: a (least recently used) must go, keeping b.
    assert residency.victims("b", 3.0) == ["a"]


def test_a_reload_of_a_loaded_model_asks_for_no_more_room() -> None:
    residency = budget_of(1)
    load(residency, "a", 0.0)
    assert residency.fits("a") and residency.victims("a", 1.0) == []


def test_the_expected_load_time_is_the_models_own_then_the_others_mean() -> None:
    residency = budget_of(3)
    assert residency.expected_load_s("a") == DEFAULT_LOAD_S
    load(residency, "a", 0.0, seconds=0.2)
    load(residency, "b", 1.0, seconds=0.4)
    assert residency.expected_load_s("a") == pytest.approx(0.2)
    assert residency.expected_load_s("c") == pytest.approx(0.3)


def test_recent_traffic_halves_every_half_life() -> None:
    residency = Residency(100 * MIB, half_life_s=10.0)
    residency.know("a", MIB)
    for _ in range(8):
        residency.used("a", 0.0)
    assert residency.recent("a", 0.0) == pytest.approx(8.0)
    assert residency.recent("a", 10.0) == pytest.approx(4.0)
    assert residency.recent("a", 30.0) == pytest.approx(1.0)


def test_prefetch_picks_the_most_wanted_model_that_fits_the_free_room() -> None:
    residency = budget_of(3, names="abcdef")
    load(residency, "a", 0.0)
    load(residency, "b", 0.0)
    for _ in range(3):
        residency.used("d", 1.0)
    for _ in range(5):
        residency.used("e", 1.0)
    residency.used("f", 1.0)
    # One model's room is free: e has the most recent traffic.
    assert residency.prefetch(2.0, ["c", "d", "e", "f"]) == "e"
    # Not a model with no traffic, nor one that does not fit without unloading another.
    assert residency.prefetch(2.0, ["c"]) is None
    load(residency, "e", 2.0)
    assert residency.prefetch(2.0, ["c", "d", "f"]) is None  # full
    # Traffic long past is no reason.
    residency.unloaded("e")
    assert residency.prefetch(1000.0, ["d", "e"]) is None


def test_no_budget_fits_everything_and_unloads_nothing() -> None:
    residency = Residency(0)
    for name in "abc":
        residency.know(name, 10 * MIB)
        load(residency, name, 0.0)
    assert residency.fits("d") and residency.victims("d", 1.0) == []
    assert residency.prefetch(0.0, ["d"]) is None


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 0"):
        Residency(-1)


def test_by_traffic_the_hot_models_stay_and_a_cold_one_just_loaded_is_next_out() -> None:
    residency = budget_of(3, names="abcdef")
    residency.eviction = "traffic"
    for at, name in enumerate("abc"):
        load(residency, name, float(at))
    for second in range(10):  # a and b are hot, c is asked for once
        for name in "ab":
            residency.used(name, 3.0 + second)
    residency.used("c", 4.0)
    residency.used("d", 13.5)  # a cold request: c (least traffic) makes room, not a or b
    assert residency.victims("d", 13.5) == ["c"]
    residency.unloaded("c")
    load(residency, "d", 13.6)
    residency.used("e", 14.0)  # the next cold one takes d's place, though d was used last
    assert residency.victims("e", 14.0) == ["d"]
    # Least recently used would have pushed a hot model out instead.
    residency.eviction = "lru"
    assert residency.victims("e", 14.0) == ["a"]


def test_an_unknown_eviction_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="eviction policy"):
        Residency(MIB, eviction="fifo")  # type: ignore[arg-type]
