"""The L2 circuit breaker with a fake clock."""

from __future__ import annotations

from tailserve.cache.breaker import Breaker, BreakerState


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_the_threshold_and_skips_calls() -> None:
    clock = Clock()
    changes: list[BreakerState] = []
    breaker = Breaker(clock=clock, threshold=3, open_s=1.0, on_change=changes.append)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    assert changes == [BreakerState.OPEN]


def test_a_success_resets_the_count() -> None:
    breaker = Breaker(clock=Clock(), threshold=2)
    breaker.failure()
    breaker.success()
    breaker.failure()
    assert breaker.state is BreakerState.CLOSED


def test_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    clock = Clock()
    breaker = Breaker(clock=clock, threshold=1, open_s=1.0)
    breaker.failure()
    clock.now = 1.0
    assert breaker.allow()  # the probe
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # only one at a time
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()


def test_a_failed_probe_doubles_the_wait_up_to_the_cap() -> None:
    clock = Clock()
    breaker = Breaker(clock=clock, threshold=1, open_s=1.0, max_open_s=3.0)
    breaker.failure()
    waits = []
    for _ in range(4):
        start = clock.now
        while not breaker.allow():
            clock.now += 0.25
        waits.append(clock.now - start)
        breaker.failure()
    assert waits == [1.0, 2.0, 3.0, 3.0]


def test_a_probe_that_ends_without_a_verdict_lets_the_next_call_probe() -> None:
    clock = Clock()
    breaker = Breaker(clock=clock, threshold=1, open_s=1.0)
    breaker.failure()
    clock.now = 1.0
    assert breaker.allow() and not breaker.allow()
    breaker.release()  # the probe was cancelled: neither success nor failure
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allow()
