"""The job pacer: jobs held follow the event loop's health, like a congestion window."""

from __future__ import annotations

from tailserve.jobs.pacing import STEP_S, Pacer, PacingConfig

CALM = {"lag_s": 0.0005, "busy": 0.2}
LATE = {"lag_s": 0.010, "busy": 0.2}
BUSY = {"lag_s": 0.0005, "busy": 0.9}
BETWEEN = {"lag_s": 0.002, "busy": 0.5}  # above the low marks, below the high ones


def test_it_starts_at_one_and_grows_by_one_a_step_while_the_loop_is_calm() -> None:
    pacer = Pacer(PacingConfig(max_jobs=4))
    assert pacer.limit == 1
    limits = [pacer.update(i * STEP_S, **CALM) for i in range(1, 6)]
    assert limits == [2, 3, 4, 4, 4]
    assert pacer.update(0.55, **CALM) == 4  # (within a step of the last change: no change)


def test_a_late_or_busy_loop_halves_it_and_holds_growth_off() -> None:
    config = PacingConfig(max_jobs=8, hold_s=1.0)
    pacer = Pacer(config)
    now = 0.0
    for _ in range(8):
        now += STEP_S
        pacer.update(now, **CALM)
    assert pacer.limit == 8
    now += STEP_S
    assert pacer.update(now, **LATE) == 4
    assert pacer.pressed
    assert pacer.update(now + 0.01, **LATE) == 4  # one cut a step
    now += STEP_S
    assert pacer.update(now, **BUSY) == 2
    # Calm again, but growth waits out the hold after the last press.
    assert pacer.update(now + 0.5, **CALM) == 2
    assert not pacer.pressed
    assert pacer.update(now + config.hold_s + 0.01, **CALM) == 3


def test_between_the_marks_nothing_changes_and_it_never_goes_below_zero() -> None:
    pacer = Pacer(PacingConfig(max_jobs=4))
    assert pacer.update(1.0, **BETWEEN) == 1
    assert pacer.update(2.0, **LATE) == 0
    assert pacer.update(3.0, **LATE) == 0
    assert pacer.update(5.0, **CALM) == 1  # back once the loop is calm and the hold is over


def test_pressing_says_whether_the_loop_has_room_now() -> None:
    pacer = Pacer()
    assert pacer.pressing(**LATE) and pacer.pressing(**BUSY)
    assert not pacer.pressing(**CALM) and not pacer.pressing(**BETWEEN)


def test_with_no_online_traffic_the_loop_is_the_jobs_alone() -> None:
    pacer = Pacer(PacingConfig(max_jobs=6))
    assert pacer.update(1.0, **BUSY, online=False) == 6
    assert not pacer.pressed
    assert not pacer.pressing(**LATE, online=False)
    assert pacer.update(1.2, **BUSY) == 3  # online requests again: halved at once
