"""Outlier ejection and readiness checks, with a fake clock (the time is passed in)."""

from __future__ import annotations

import math
import random

import pytest

from tailserve.router import (
    ActiveHealth,
    Backend,
    Balancer,
    BoundedLoadHash,
    Ejection,
    OutlierDetector,
    Pool,
    PowerOfTwo,
    RoundRobin,
)


def pool_of(count: int) -> Pool:
    return Pool("churn", [Backend(f"w{i}") for i in range(count)])


def fail(pool: Pool, detector: OutlierDetector, backend: Backend, now: float) -> Ejection | None:
    pool.start(backend)
    pool.finish(backend, 0.002, ok=False)
    return detector.observe(pool, backend, now)


def reply(
    pool: Pool, detector: OutlierDetector, backend: Backend, latency_s: float, now: float
) -> Ejection | None:
    pool.start(backend)
    pool.finish(backend, latency_s, ok=True)
    return detector.observe(pool, backend, now)


def fail_until_ejected(
    pool: Pool, detector: OutlierDetector, backend: Backend, now: float
) -> float:
    """Fails the backend until it is ejected; answers the backoff it got."""
    for _ in range(detector.consecutive_failures):
        ejection = fail(pool, detector, backend, now)
        if ejection is not None:
            return ejection.backoff_s
    raise AssertionError(f"{backend.id} was not ejected")


# --- consecutive failures ------------------------------------------------------------------------


def test_ejected_after_n_consecutive_failures_and_not_before() -> None:
    pool = pool_of(4)
    bad = pool.backends[0]
    detector = OutlierDetector(consecutive_failures=3, base_ejection_s=5.0)
    assert fail(pool, detector, bad, now=1.0) is None
    assert fail(pool, detector, bad, now=1.0) is None
    assert not bad.is_ejected(1.0)
    ejection = fail(pool, detector, bad, now=1.0)
    assert ejection == Ejection("w0", "failures", until=6.0, backoff_s=5.0)
    assert bad.is_ejected(5.9) and not bad.is_ejected(6.0)


def test_a_success_in_between_resets_the_streak() -> None:
    pool = pool_of(4)
    flaky = pool.backends[0]
    detector = OutlierDetector(consecutive_failures=3)
    for _ in range(10):
        assert fail(pool, detector, flaky, now=1.0) is None
        assert fail(pool, detector, flaky, now=1.0) is None
        assert reply(pool, detector, flaky, 0.01, now=1.0) is None
    assert not flaky.is_ejected(1.0)


def test_failed_connects_count_as_failures() -> None:
    pool = pool_of(4)
    gone = pool.backends[1]
    detector = OutlierDetector(consecutive_failures=2)
    ejections = []
    for _ in range(2):
        pool.start(gone)
        pool.connect_failed(gone)
        ejections.append(detector.observe(pool, gone, now=0.0))
    assert ejections[0] is None and ejections[1] is not None
    assert ejections[1].reason == "failures"


def everyone() -> list[Balancer]:
    return [RoundRobin(), PowerOfTwo(random.Random(9)), BoundedLoadHash()]


@pytest.mark.parametrize("balancer", everyone(), ids=lambda b: type(b).__name__)
def test_an_ejected_backend_gets_no_traffic_and_comes_back_after_the_backoff(
    balancer: Balancer,
) -> None:
    pool = pool_of(4)
    bad = pool.backends[2]
    detector = OutlierDetector(consecutive_failures=3, base_ejection_s=5.0)
    assert fail_until_ejected(pool, detector, bad, now=10.0) == 5.0
    keys = [f"key-{i}" for i in range(400)]
    during = [balancer.choose(pool, key, now) for key in keys for now in (10.0, 12.5, 14.99)]
    assert bad not in during and None not in during
    after = [balancer.choose(pool, key, 15.0) for key in keys]
    assert bad in after
    # Re-admitted with a clean slate: the old streak does not eject it at the next failure.
    assert detector.readmit(pool, now=15.0) == [bad]
    assert bad.consecutive_failures == 0
    assert fail(pool, detector, bad, now=15.0) is None


def test_late_replies_from_before_the_ejection_do_not_count_once_it_is_back() -> None:
    pool = pool_of(4)
    bad = pool.backends[0]
    detector = OutlierDetector(consecutive_failures=3, base_ejection_s=5.0)
    for _ in range(5):
        pool.start(bad)  # sent before it failed
    fail_until_ejected(pool, detector, bad, now=0.0)
    for _ in range(5):  # ... and timing out while it is out
        pool.finish(bad, 1.0, ok=False)
        assert detector.observe(pool, bad, now=1.0) is None
    assert bad.in_flight == 0
    # Back at t=5: two new failures are not enough to eject it again.
    assert fail(pool, detector, bad, now=5.0) is None
    assert fail(pool, detector, bad, now=5.0) is None
    assert fail(pool, detector, bad, now=5.0) is not None


def test_the_backoff_doubles_on_each_ejection_up_to_the_cap() -> None:
    pool = pool_of(4)
    bad = pool.backends[0]
    detector = OutlierDetector(
        consecutive_failures=2, base_ejection_s=1.0, max_ejection_s=5.0, reset_after_s=60.0
    )
    now = 0.0
    backoffs = []
    for _ in range(5):
        backoff = fail_until_ejected(pool, detector, bad, now)
        backoffs.append(backoff)
        now += backoff  # back in at once, and failing again at once
    assert backoffs == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_slow_backend_is_ejected_for_longer_than_a_failing_one() -> None:
    # Failed connects: a restarted worker is back in seconds. Slowness (latency, limping)
    # tends to last: its backoff starts from the slow base, and doubles from there.
    pool = pool_of(4)
    detector = OutlierDetector(
        consecutive_failures=2,
        base_ejection_s=5.0,
        slow_base_ejection_s=30.0,
        min_samples=5,
        latency_floor_s=0.0,
        max_ejection_s=300.0,
    )
    failing, slow, *_ = pool.backends
    warm(pool, detector, {"w0": 0.010, "w1": 0.010, "w2": 0.010, "w3": 0.010}, count=5)
    assert fail_until_ejected(pool, detector, failing, now=0.0) == 5.0
    replies = [reply(pool, detector, slow, 0.500, now=0.0) for _ in range(10)]
    ejection = next(e for e in replies if e is not None)
    assert ejection.reason == "latency" and ejection.backoff_s == 30.0
    assert detector.eject(pool, slow, 31.0, "overtaken") is not None
    assert slow.ejected_until == 31.0 + 60.0
    with pytest.raises(ValueError, match="slow_base_ejection_s"):
        OutlierDetector(slow_base_ejection_s=500.0)


def test_the_doubling_is_forgotten_once_the_backend_stays_in_a_while() -> None:
    pool = pool_of(4)
    bad = pool.backends[0]
    detector = OutlierDetector(consecutive_failures=2, base_ejection_s=1.0, reset_after_s=30.0)
    assert fail_until_ejected(pool, detector, bad, now=0.0) == 1.0
    assert fail_until_ejected(pool, detector, bad, now=1.0) == 2.0
    # Back at t=3, healthy for 29 s: still remembered.
    assert detector.readmit(pool, now=3.0) == [bad]
    assert fail_until_ejected(pool, detector, bad, now=32.0) == 4.0
    # Back at t=36, healthy for 30 s: forgiven.
    assert detector.readmit(pool, now=36.0) == [bad]
    assert fail_until_ejected(pool, detector, bad, now=66.0) == 1.0


def test_never_more_than_the_max_fraction_of_the_pool_is_ejected() -> None:
    pool = pool_of(5)
    detector = OutlierDetector(consecutive_failures=1, max_ejected_fraction=0.5)
    # A pool-wide failure (a bad model version): every backend fails.
    ejections = [fail(pool, detector, backend, now=0.0) for backend in pool for _ in range(3)]
    assert len([e for e in ejections if e is not None]) == 2  # floor(0.5 x 5)
    assert len(pool.ejected(0.0)) == 2
    assert len(pool.available(0.0)) == 3
    # When the ejected come back, others may take their places.
    detector.readmit(pool, now=100.0)
    remaining = [b for b in pool if b.consecutive_failures > 0]
    assert fail(pool, detector, remaining[0], now=100.0) is not None


def test_a_lone_backend_is_never_ejected() -> None:
    pool = pool_of(1)
    detector = OutlierDetector(consecutive_failures=1)
    assert all(fail(pool, detector, pool.backends[0], now=0.0) is None for _ in range(10))
    assert pool.available(0.0) == pool.backends


def test_a_fraction_of_zero_disables_ejection() -> None:
    pool = pool_of(4)
    detector = OutlierDetector(consecutive_failures=1, max_ejected_fraction=0.0)
    assert fail(pool, detector, pool.backends[0], now=0.0) is None


# --- latency outliers ---------------------------------------------------------------------------


def warm(pool: Pool, detector: OutlierDetector, latencies: dict[str, float], count: int) -> None:
    for _ in range(count):
        for backend in pool:
            reply(pool, detector, backend, latencies[backend.id], now=0.0)


def test_a_backend_far_slower_than_the_others_is_ejected() -> None:
    pool = pool_of(4)
    detector = OutlierDetector(latency_factor=3.0, latency_floor_s=0.05, min_samples=20)
    latencies = {"w0": 0.200, "w1": 0.010, "w2": 0.012, "w3": 0.011}
    warm(pool, detector, {**latencies, "w0": 0.010}, count=20)
    slow = pool.backends[0]
    # It slows down to 200 ms. Its average (alpha 0.2) goes 48 ms: over 3 x the others'
    # median (33 ms) but under the floor (50 ms); then 78 ms: out.
    assert reply(pool, detector, slow, latencies["w0"], now=0.0) is None
    ejection = reply(pool, detector, slow, latencies["w0"], now=0.0)
    assert ejection is not None and ejection.reason == "latency"
    assert [b.id for b in pool.ejected(0.0)] == ["w0"]


def test_no_latency_ejection_before_the_minimum_samples() -> None:
    pool = pool_of(3)
    detector = OutlierDetector(min_samples=20, latency_floor_s=0.0)
    slow, *others = pool.backends
    for _ in range(20):
        for other in others:
            reply(pool, detector, other, 0.010, now=0.0)
    for _ in range(19):
        assert reply(pool, detector, slow, 1.0, now=0.0) is None
    assert reply(pool, detector, slow, 1.0, now=0.0) is not None


def test_fast_enough_is_not_an_outlier_however_the_ratio() -> None:
    pool = pool_of(3)
    detector = OutlierDetector(min_samples=5, latency_factor=3.0, latency_floor_s=0.05)
    warm(pool, detector, {"w0": 0.040, "w1": 0.001, "w2": 0.001}, count=50)
    assert pool.ejected(0.0) == []  # 40x the median, but under 50 ms


def test_a_pool_wide_slowdown_ejects_no_one() -> None:
    pool = pool_of(4)
    detector = OutlierDetector(min_samples=5, latency_floor_s=0.0)
    warm(pool, detector, {"w0": 0.500, "w1": 0.450, "w2": 0.520, "w3": 0.480}, count=50)
    assert pool.ejected(0.0) == []


def test_in_a_pool_of_two_the_slow_one_is_compared_with_the_other() -> None:
    pool = pool_of(2)
    detector = OutlierDetector(min_samples=5, latency_floor_s=0.0)
    warm(pool, detector, {"w0": 0.010, "w1": 0.010}, count=5)
    ejections = [reply(pool, detector, pool.backends[1], 0.300, now=0.0) for _ in range(20)]
    assert any(e is not None and e.backend_id == "w1" for e in ejections)


def test_a_latency_outlier_is_readmitted_with_its_average_forgotten() -> None:
    pool = pool_of(3)
    detector = OutlierDetector(min_samples=5, latency_floor_s=0.0, base_ejection_s=2.0)
    warm(pool, detector, {"w0": 0.010, "w1": 0.010, "w2": 0.010}, count=5)
    slow = pool.backends[0]
    while reply(pool, detector, slow, 0.500, now=1.0) is None:
        pass
    assert detector.readmit(pool, now=3.0) == [slow]
    assert slow.latency_s is None and slow.samples == 0
    # Recovered: fast replies keep it in (the old slow average would eject it at once).
    assert all(reply(pool, detector, slow, 0.010, now=3.0) is None for _ in range(20))


# --- readiness checks ---------------------------------------------------------------------------


def test_readiness_checks_take_a_backend_out_and_bring_it_back() -> None:
    pool = pool_of(3)
    draining = pool.backends[1]
    checks = ActiveHealth(unhealthy_after=2, healthy_after=1)
    assert not checks.record(draining, ready=False)
    assert draining.healthy  # one failed check may be a blip
    assert checks.record(draining, ready=False)
    assert not draining.healthy
    for balancer in everyone():
        assert all(balancer.choose(pool, f"k{i}", 0.0) is not draining for i in range(100))
    assert checks.record(draining, ready=True)
    assert draining in pool.available(0.0)


def test_a_passing_check_resets_the_failed_streak() -> None:
    backend = Backend("a")
    checks = ActiveHealth(unhealthy_after=2)
    for _ in range(5):
        checks.record(backend, ready=False)
        checks.record(backend, ready=True)
    assert backend.healthy


def test_coming_back_can_require_several_passes() -> None:
    backend = Backend("a", healthy=False)
    checks = ActiveHealth(healthy_after=3)
    assert [checks.record(backend, ready=True) for _ in range(3)] == [False, False, True]
    assert backend.healthy


def test_a_dead_replicas_last_latency_does_not_get_the_survivor_ejected() -> None:
    # Two replicas at 50 ms; one dies (its connects fail) and the survivor, taking all the
    # load, slows to 200 ms: four times the dead one's last average, but it is the only one
    # answering, and there is no one left to judge it against.
    pool = pool_of(2)
    detector = OutlierDetector(min_samples=5, latency_floor_s=0.0)
    warm(pool, detector, {"w0": 0.050, "w1": 0.050}, count=5)
    dead, survivor = pool.backends
    pool.start(dead)
    pool.connect_failed(dead)
    assert detector.observe(pool, dead, now=0.0) is None  # one failure: not yet ejected
    ejections = [reply(pool, detector, survivor, 0.200, now=0.0) for _ in range(20)]
    assert ejections == [None] * 20 and pool.ejected(0.0) == []
    # Once the other answers again, it is a reference again.
    reply(pool, detector, dead, 0.050, now=0.0)
    assert detector.is_latency_outlier(pool, survivor, now=0.0)


def test_a_killed_replicas_late_replies_do_not_make_it_a_reference_again() -> None:
    # SIGKILL: connects fail at once, but replies the dead worker sent just before are read
    # after (successes, resetting its streak). For a few seconds it is still no reference:
    # the survivor, slower under the load it took over, stays in.
    pool = pool_of(2)
    detector = OutlierDetector(min_samples=5, latency_floor_s=0.0)
    warm(pool, detector, {"w0": 0.050, "w1": 0.050}, count=5)
    dead, survivor = pool.backends
    pool.start(dead)
    pool.connect_failed(dead, now=10.0)
    assert reply(pool, detector, dead, 0.050, now=10.1) is None  # from its socket buffer
    assert dead.consecutive_failures == 0
    ejections = [reply(pool, detector, survivor, 0.200, now=10.2) for _ in range(20)]
    assert ejections == [None] * 20 and pool.ejected(10.2) == []
    # Quiet for long enough, it is a reference again.
    reply(pool, detector, dead, 0.050, now=15.1)
    assert detector.is_latency_outlier(pool, survivor, now=15.1)


# --- limping: requests that keep losing to hedges ------------------------------------------------


def first_copy(
    pool: Pool, detector: OutlierDetector, backend: Backend, lost: bool, now: float = 0.0
) -> Ejection | None:
    """One request's first copy to ``backend``: answered (``lost`` False), or beaten by a hedge
    sent elsewhere (then withdrawn, and the next reply of ``backend`` is judged)."""
    pool.start(backend)
    pool.overtaken(backend, lost)
    if lost:
        pool.cancelled(backend)
        return None
    pool.finish(backend, 0.007, ok=True)
    return detector.observe(pool, backend, now)


def test_a_replica_whose_requests_keep_losing_to_hedges_is_ejected_as_limping() -> None:
    pool = pool_of(4)
    detector = OutlierDetector(latency_floor_s=0.05)
    limping, *healthy = pool.backends
    for i in range(100):  # the others: one loss in a hundred
        for backend in healthy:
            first_copy(pool, detector, backend, lost=i == 50)
    # One request in twenty stalls and loses to its hedge. Its average latency says nothing
    # (7 ms): the losses do, once there are five of them.
    ejections = []
    for i in range(200):
        ejections.append(first_copy(pool, detector, limping, lost=i % 20 == 19))
        if ejections[-1] is not None:
            break
    ejection = ejections[-1]
    assert ejection is not None and ejection.reason == "overtaken" and ejection.backend_id == "w0"
    assert len(ejections) == 5 * 20 + 1  # judged on its first reply after the fifth loss
    assert pool.ejected(0.0) == [limping]
    # Ejection forgets the counts (only new losses may eject it again), not the average share
    # hedging reads: back from its backoff, its late requests are hedged at their delay.
    assert (limping.first_copies, limping.first_losses) == (0, 0)
    assert pool.suspect(limping)


def test_a_healthy_tail_that_loses_a_hedge_now_and_then_is_never_ejected() -> None:
    # Every replica loses one request in two hundred to a hedge, at random: over 100,000
    # requests no window of a few hundred holds five losses and 2% on the same replica.
    rng = random.Random(11)
    pool = pool_of(4)
    detector = OutlierDetector()
    for _ in range(25_000):
        for backend in pool:
            assert first_copy(pool, detector, backend, lost=rng.random() < 0.005) is None
    assert pool.ejected(0.0) == []


def test_a_pool_wide_run_of_losses_ejects_no_one() -> None:
    # Everything stalls now and then (the machine, not a replica): each replica loses 5%,
    # no more than its peers, so no one is ejected.
    pool = pool_of(4)
    detector = OutlierDetector()
    for i in range(400):
        for backend in pool:
            assert first_copy(pool, detector, backend, lost=i % 20 == 19) is None
    assert all(b.first_losses >= 5 for b in pool)


def test_limping_is_judged_against_two_others_that_have_answered_enough() -> None:
    pool = pool_of(4)
    detector = OutlierDetector(min_samples=20)
    limping, other, second, newcomer = pool.backends
    for _ in range(20):
        first_copy(pool, detector, other, lost=False)
    for _ in range(19):
        first_copy(pool, detector, second, lost=False)
    for _ in range(10):
        assert first_copy(pool, detector, limping, lost=True) is None
    # Not one reply yet from the newcomer and 19 from the second: one peer to compare with.
    assert first_copy(pool, detector, limping, lost=False) is None
    first_copy(pool, detector, second, lost=False)
    ejection = first_copy(pool, detector, limping, lost=False)
    assert ejection is not None and ejection.reason == "overtaken"
    assert newcomer.first_copies == 0


def test_in_a_pool_of_two_no_one_is_ejected_for_limping() -> None:
    # Both slow down alike and race each other's hedges: whichever loses a few more must not
    # be taken out on the word of the other alone.
    pool = pool_of(2)
    detector = OutlierDetector()
    limping, other = pool.backends
    for _ in range(50):
        first_copy(pool, detector, other, lost=False)
    assert all(first_copy(pool, detector, limping, lost=i % 4 == 0) is None for i in range(200))
    assert pool.ejected(0.0) == []
    assert OutlierDetector(overtaken_min_peers=1).is_limping(pool, limping, 0.0)


def test_a_share_out_of_reach_turns_limping_ejection_off() -> None:
    pool = pool_of(3)
    detector = OutlierDetector(overtaken_share=math.inf)
    limping, *others = pool.backends
    for _ in range(50):
        for other in others:
            first_copy(pool, detector, other, lost=False)
    assert all(first_copy(pool, detector, limping, lost=i % 2 == 0) is None for i in range(200))
    assert pool.ejected(0.0) == []


def test_losses_are_counted_over_the_last_few_hundred_requests() -> None:
    pool = pool_of(1)
    backend = pool.backends[0]
    for i in range(199):
        pool.overtaken(backend, lost=i < 10)
    assert (backend.first_copies, backend.first_losses) == (199, 10)
    pool.overtaken(backend, lost=False)  # the 200th: both halve
    assert (backend.first_copies, backend.first_losses) == (100, 5)
    # Old losses fade: after 300 clean requests, one more halving has passed.
    for _ in range(300):
        pool.overtaken(backend, lost=False)
    assert backend.first_losses <= 2
