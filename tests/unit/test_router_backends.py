"""A pool's bookkeeping of its backends: in flight, latency average, failures, availability."""

from __future__ import annotations

import random

import pytest

from tailserve.router import Backend, Pool


def test_the_url_defaults_to_the_id() -> None:
    assert Backend("http://w1:8000").url == "http://w1:8000"
    assert Backend("w1", "http://10.0.0.1:8000").url == "http://10.0.0.1:8000"


def test_in_flight_counts_each_attempt_until_it_ends() -> None:
    backend = Backend("a")
    pool = Pool("churn", [backend])
    for _ in range(3):
        pool.start(backend)
    assert backend.in_flight == pool.in_flight == 3
    pool.finish(backend, 0.01, ok=True)
    pool.connect_failed(backend)
    pool.cancelled(backend)
    assert backend.in_flight == 0
    with pytest.raises(ValueError, match="no request in flight"):
        pool.finish(backend, 0.01, ok=True)


def test_the_latency_average_starts_at_the_first_sample_and_moves_by_alpha() -> None:
    backend = Backend("a")
    pool = Pool("churn", [backend], ewma_alpha=0.5)
    for latency in (0.010, 0.020, 0.040):
        pool.start(backend)
        pool.finish(backend, latency, ok=True)
    # 0.010, then 0.010 + 0.5 * 0.010 = 0.015, then 0.015 + 0.5 * 0.025 = 0.0275
    assert backend.latency_s == pytest.approx(0.0275)
    assert backend.samples == 3


def test_a_fast_failure_never_makes_a_backend_look_faster_but_a_timeout_slower() -> None:
    backend = Backend("a")
    pool = Pool("churn", [backend], ewma_alpha=0.5)
    pool.start(backend)
    pool.finish(backend, 0.020, ok=True)
    pool.start(backend)
    pool.finish(backend, 0.001, ok=False)  # a 500 in a millisecond
    assert backend.latency_s == pytest.approx(0.020)
    pool.start(backend)
    pool.finish(backend, 1.0, ok=False)  # a timeout after a second
    assert backend.latency_s == pytest.approx(0.510)
    assert backend.consecutive_failures == 2


def test_a_success_ends_the_failure_streak_and_a_failed_connect_extends_it() -> None:
    backend = Backend("a")
    pool = Pool("churn", [backend])
    for _ in range(2):
        pool.start(backend)
        pool.connect_failed(backend)
    assert backend.consecutive_failures == 2
    pool.start(backend)
    pool.finish(backend, 0.01, ok=True)
    assert backend.consecutive_failures == 0


def test_a_fast_refusal_never_makes_a_backend_look_faster_nor_ends_its_streak() -> None:
    pool = Pool("m", [Backend("w0")])
    backend = pool.backends[0]
    pool.start(backend)
    pool.finish(backend, 0.010, ok=True)
    pool.start(backend)
    pool.finish(backend, 0.5, ok=False)  # a timeout: one failure, and slower
    average = backend.latency_s
    assert average is not None and backend.consecutive_failures == 1
    pool.start(backend)
    pool.refused(backend, 0.0005, now=1.0)  # a 429 in half a millisecond
    assert backend.latency_s == average and backend.consecutive_failures == 1
    assert backend.in_flight == 0 and backend.samples == 2 and backend.sampled_at == 1.0
    pool.start(backend)
    pool.refused(backend, 1.0)  # refused after a long wait: that slowness counts
    assert backend.latency_s > average and backend.samples == 3


def test_a_cancelled_hedge_adds_no_sample_and_no_failure() -> None:
    backend = Backend("a")
    pool = Pool("churn", [backend])
    pool.start(backend)
    pool.cancelled(backend)
    assert (backend.samples, backend.latency_s, backend.consecutive_failures) == (0, None, 0)


def test_a_copy_that_lost_to_another_counts_as_at_least_that_slow() -> None:
    backend = Backend("a")
    pool = Pool("churn", [backend], ewma_alpha=0.5)
    pool.start(backend)
    pool.finish(backend, 0.006, ok=True)
    # Overtaken after 14 ms: longer than its 6 ms average, so it is a sample (a lower bound).
    pool.start(backend)
    pool.cancelled(backend, lost_after_s=0.014)
    assert backend.latency_s == pytest.approx(0.010) and backend.samples == 2
    # Lost 2 ms after it went (a hedge copy the first reply beat): says nothing, no sample.
    pool.start(backend)
    pool.cancelled(backend, lost_after_s=0.002)
    assert backend.latency_s == pytest.approx(0.010) and backend.samples == 2
    assert backend.consecutive_failures == 0 and backend.in_flight == 0


def test_available_means_healthy_not_ejected_and_under_the_limit() -> None:
    ok, sick, ejected, full = (Backend(name, max_in_flight=2) for name in "abcd")
    pool = Pool("churn", [ok, sick, ejected, full])
    sick.healthy = False
    ejected.ejected_until = 10.0
    full.in_flight = 2
    assert pool.available(now=5.0) == [ok]
    assert pool.in_service(now=5.0) == [ok, full]
    assert pool.ejected(now=5.0) == [ejected]
    # The ejection runs out at its time.
    assert pool.available(now=10.0) == [ok, ejected]


def test_membership() -> None:
    a, b = Backend("a"), Backend("b")
    pool = Pool("churn", [a, b])
    with pytest.raises(ValueError, match="already"):
        pool.add(Backend("a"))
    assert pool.remove("a") is a
    assert pool.remove("a") is None
    assert pool.ids == ("b",) and len(pool) == 1
    assert b in pool and a not in pool
    assert pool.get("b") is b


@pytest.mark.parametrize("alpha", [0.0, 1.5])
def test_the_decay_must_be_a_weight(alpha: float) -> None:
    with pytest.raises(ValueError, match="ewma_alpha"):
        Pool("churn", ewma_alpha=alpha)


def test_a_replica_whose_requests_keep_losing_to_hedges_is_suspect_until_it_recovers() -> None:
    rng = random.Random(3)
    backends = [Backend(f"w{i}") for i in range(4)]
    pool = Pool("m", backends)
    slow, healthy = backends[3], backends[:3]
    flagged = {b.id: 0 for b in backends}
    checks = 2_000
    for n in range(checks + 500):
        for b in backends:  # 5% of the slow one's requests overtaken, 0.5% of the others'
            pool.overtaken(b, rng.random() < (0.05 if b is slow else 0.005))
        if n >= 500:  # after a warm-up of 500 requests each
            for b in backends:
                flagged[b.id] += pool.suspect(b)
    assert flagged[slow.id] >= 0.8 * checks, flagged  # 1,866 of 2,000
    assert all(flagged[b.id] <= 0.1 * checks for b in healthy), flagged  # 32, 38, 88 of 2,000
    # It recovers: a hundred requests answered first and it is no longer suspect.
    for _ in range(100):
        pool.overtaken(slow, False)
    assert not pool.suspect(slow)
