"""When to hedge (the model's recent p95) and how many copies the budgets allow."""

from __future__ import annotations

import math
import random

import pytest

from tailserve.router import Backend, HedgeBudget, HedgePolicy, Pool, RetryBudget, TokenBudget

# --- the hedge delay --------------------------------------------------------------------------


def test_no_hedging_until_enough_replies_are_known() -> None:
    policy = HedgePolicy(min_samples=50)
    for i in range(49):
        policy.observe(0.010, now=i * 0.01)
        assert policy.delay_s() is None
    policy.observe(0.010, now=1.0)
    assert policy.delay_s() == pytest.approx(0.010)


def test_the_delay_is_the_nearest_rank_p95_of_the_window() -> None:
    policy = HedgePolicy(window=100, min_samples=10)
    latencies = [ms / 1000 for ms in range(1, 101)]
    random.Random(4).shuffle(latencies)
    for i, latency in enumerate(latencies):
        policy.observe(latency, now=i * 0.001)
    assert policy.delay_s() == pytest.approx(0.095)


def test_the_delay_tracks_the_p95_of_a_known_distribution_and_follows_a_shift() -> None:
    rng = random.Random(21)
    policy = HedgePolicy(window=2_000, max_age_s=1e9)
    now = 0.0
    mean = 0.010
    for _ in range(5_000):
        now += 0.001
        policy.observe(rng.expovariate(1 / mean), now)
    # An exponential's p95 is mean · ln 20.
    assert policy.delay_s() == pytest.approx(mean * math.log(20), rel=0.1)
    # The model slows down threefold (a bigger version, a noisy neighbour): within a window's
    # worth of replies the delay follows...
    for _ in range(2_000):
        now += 0.001
        policy.observe(rng.expovariate(1 / (3 * mean)), now)
    assert policy.delay_s() == pytest.approx(3 * mean * math.log(20), rel=0.1)
    # ... and back down when it recovers.
    for _ in range(2_000):
        now += 0.001
        policy.observe(rng.expovariate(1 / mean), now)
    assert policy.delay_s() == pytest.approx(mean * math.log(20), rel=0.1)


def test_an_upward_shift_shows_well_before_the_window_turns_over() -> None:
    policy = HedgePolicy(window=1_000, max_age_s=1e9)
    for i in range(1_000):
        policy.observe(0.010, now=i * 0.001)
    for i in range(60):  # 6% of the window is now slow: above the 95th percentile's rank
        policy.observe(0.200, now=1.0 + i * 0.001)
    assert policy.delay_s() == pytest.approx(0.200)


def test_old_samples_age_out() -> None:
    policy = HedgePolicy(window=1_000, max_age_s=10.0, min_samples=20)
    for i in range(100):
        policy.observe(0.500, now=i * 0.01)
    assert policy.delay_s(now=5.0) == pytest.approx(0.500)
    # Twenty seconds later, only the recent replies count.
    for i in range(30):
        policy.observe(0.020, now=20.0 + i * 0.01)
    assert len(policy) == 30
    assert policy.delay_s() == pytest.approx(0.020)
    # After a quiet spell there is nothing recent to go by: no hedging on stale numbers.
    assert policy.delay_s(now=100.0) is None


def test_the_window_is_bounded() -> None:
    policy = HedgePolicy(window=100, min_samples=10, max_age_s=1e9)
    for i in range(1_000):
        policy.observe(i / 1000, now=float(i))
    assert len(policy) == 100
    # The last hundred samples, 0.900 .. 0.999: their p95 is the 95th of them.
    assert policy.delay_s() == pytest.approx(0.994)


def test_the_delay_is_floored_and_capped() -> None:
    policy = HedgePolicy(min_samples=10, min_delay_s=0.002, max_delay_s=0.5)
    for i in range(20):
        policy.observe(0.0001, now=i * 0.01)
    assert policy.delay_s() == 0.002
    for i in range(1_000):
        policy.observe(5.0, now=1.0 + i * 0.001)
    assert policy.delay_s() == 0.5


def test_on_request_earns_budget_and_answers_the_delay() -> None:
    policy = HedgePolicy(min_samples=10, budget=HedgeBudget(ratio=0.5, cap=2.0))
    assert policy.on_request(now=0.0) is None
    for i in range(10):
        policy.observe(0.030, now=i * 0.01)
    assert policy.on_request(now=1.0) == pytest.approx(0.030)
    assert policy.budget.requests == 2
    assert policy.try_hedge()  # 2 x 0.5 = 1 token
    assert not policy.try_hedge()


# --- rationing ---------------------------------------------------------------------------------


def test_a_hedge_goes_out_at_once_only_while_the_budget_holds_half_its_cap() -> None:
    policy = HedgePolicy(budget=HedgeBudget(cap=10.0, initial=5.0))
    assert policy.try_hedge()  # 5 tokens: plenty
    assert not policy.try_hedge()  # 4 left: rationed, though a token is there
    assert policy.budget.spent == 1 and policy.budget.refused == 1
    assert policy.budget.tokens == pytest.approx(4.0)


def _learned(policy: HedgePolicy, latencies: list[float]) -> HedgePolicy:
    for i, latency in enumerate(latencies):
        policy.observe(latency, now=i * 0.001)
    return policy


# 1,000 healthy replies: p95 9 ms, p99 12 ms (nearest rank).
HEALTHY = [0.007] * 900 + [0.009] * 50 + [0.012] * 40 + [0.014] * 10


def test_while_rationed_a_waiting_request_takes_a_token_after_the_p99() -> None:
    now = 1.0
    rationed = _learned(HedgePolicy(budget=HedgeBudget(cap=10.0, initial=2.0)), HEALTHY)
    assert rationed.delay_s(now) == pytest.approx(0.009)
    assert rationed.overdue_s(now) == pytest.approx(0.012)
    assert not rationed.may_hedge_late(waited_s=0.011, now=now)
    assert rationed.may_hedge_late(waited_s=0.012, now=now)
    broke = _learned(HedgePolicy(budget=HedgeBudget(cap=10.0, initial=0.5)), HEALTHY)
    assert not broke.may_hedge_late(waited_s=1.0, now=now)
    flush = _learned(HedgePolicy(budget=HedgeBudget(cap=10.0, initial=6.0)), HEALTHY)
    assert flush.may_hedge_late(waited_s=0.009, now=now)
    assert HedgePolicy().overdue_s() is None  # nothing known: no hedging at all


def _stuck_hedged_in_time(ration: bool) -> tuple[int, int, float]:
    """A request every 5 ms for 200 s, with healthy replies as in HEALTHY and 1.25% stuck
    (200 ms); a hedge comes due at the p95 (9 ms). Simulated in 1 ms ticks, tokens handed out
    as they are earned (on arrivals), like the dispatcher. Returns the stuck requests, those of
    them hedged by 25 ms (a healthy reply's time after the p99), and copies per request."""
    rng = random.Random(11)
    policy = _learned(HedgePolicy(budget=HedgeBudget()), HEALTHY)
    count, gap, stuck_ms = 40_000, 5, 200
    latency = [
        stuck_ms if rng.random() < 0.0125 else round(rng.choice(HEALTHY) * 1e3)
        for _ in range(count)
    ]
    due = policy.delay_s(1.0)
    assert due is not None
    delay = round(due * 1e3)
    waiting: list[int] = []
    stuck = in_time = 0
    for tick in range(count * gap):
        now = 1.0  # the window is fixed: the policy's clock only ages samples out
        if tick % gap == 0:
            policy.budget.earn()  # request tick // gap arrives
            while waiting:  # the tokens earned go to the waiting, oldest first
                j = waiting[0]
                waited = tick - j * gap
                if latency[j] <= waited:
                    waiting.pop(0)  # answered meanwhile
                elif ration and policy.may_hedge_late(waited / 1e3, now):
                    assert policy.budget.try_spend()
                    waiting.pop(0)
                    in_time += latency[j] == stuck_ms and waited <= 25
                else:
                    break
        if (tick - delay) % gap == 0 and tick >= delay:
            j = (tick - delay) // gap  # its hedge comes due now
            if latency[j] > delay:
                stuck += latency[j] == stuck_ms
                if policy.try_hedge() if ration else policy.budget.try_spend():
                    in_time += latency[j] == stuck_ms
                elif ration:
                    waiting.append(j)
    return stuck, in_time, policy.budget.spent / count


def test_rationing_spends_the_budget_on_the_stuck_requests() -> None:
    stuck, in_time, extra = _stuck_hedged_in_time(ration=True)
    assert stuck > 400
    assert in_time >= 0.99 * stuck, (in_time, stuck)
    assert extra <= 0.05 + 10 / 40_000
    # Spent as they come due, the same tokens go mostly to the healthy replies just past the
    # p95, and stuck requests find the bucket empty.
    stuck, in_time, _ = _stuck_hedged_in_time(ration=False)
    assert in_time < 0.95 * stuck, (in_time, stuck)


def test_while_rationed_a_request_on_a_suspect_replica_takes_a_token_at_its_delay() -> None:
    policy = HedgePolicy(budget=HedgeBudget(cap=10.0, initial=2.0))
    assert not policy.try_hedge()  # rationed
    assert policy.try_hedge(suspect=True)  # a token is there
    assert policy.budget.spent == 1 and policy.budget.refused == 1
    broke = HedgePolicy(budget=HedgeBudget(cap=10.0, initial=0.5))
    assert not broke.try_hedge(suspect=True)  # no token: it waits like any other
    assert broke.budget.refused == 1


def _stuck_hedged_at_delay(suspicion: bool) -> tuple[int, int, float]:
    """Four replicas in turn, a request every 5 ms for 200 s; 5% of replica 3's requests stuck
    (200 ms), the rest as in HEALTHY. A hedge comes due at the p95 (9 ms); while rationed it
    waits for the p99, unless (with ``suspicion``) its replica is suspect. A hedge's copy
    takes 7 ms, so a healthy request hedged loses only if it was to take longer than that
    more. Returns the stuck requests, those of them hedged at the delay, copies per request."""
    rng = random.Random(5)
    backends = [Backend(f"w{i}") for i in range(4)]
    pool = Pool("m", backends)
    policy = _learned(HedgePolicy(budget=HedgeBudget()), HEALTHY)
    count, gap, stuck_ms, copy_ms = 40_000, 5, 200, 7
    latency = [
        stuck_ms if j % 4 == 3 and rng.random() < 0.05 else round(rng.choice(HEALTHY) * 1e3)
        for j in range(count)
    ]
    due = policy.delay_s(1.0)
    assert due is not None
    delay = round(due * 1e3)
    waiting: list[int] = []
    stuck = at_delay = 0

    def hedged(j: int, waited: int) -> None:
        pool.overtaken(backends[j % 4], latency[j] > waited + copy_ms)

    for tick in range(count * gap):
        if tick % gap == 0:
            policy.budget.earn()
            while waiting:
                j = waiting[0]
                waited = tick - j * gap
                if latency[j] <= waited:
                    waiting.pop(0)
                    pool.overtaken(backends[j % 4], False)
                elif policy.may_hedge_late(waited / 1e3, 1.0):
                    assert policy.budget.try_spend()
                    waiting.pop(0)
                    hedged(j, waited)
                else:
                    break
        if (tick - delay) % gap == 0 and tick >= delay:
            j = (tick - delay) // gap
            if latency[j] <= delay:
                pool.overtaken(backends[j % 4], False)
                continue
            stuck += latency[j] == stuck_ms
            suspect = suspicion and pool.suspect(backends[j % 4])
            if policy.try_hedge(suspect=suspect):
                at_delay += latency[j] == stuck_ms
                hedged(j, delay)
            else:
                waiting.append(j)
    return stuck, at_delay, policy.budget.spent / count


def test_suspicion_hedges_the_stuck_replicas_requests_at_their_delay() -> None:
    stuck, at_delay, extra = _stuck_hedged_at_delay(suspicion=True)
    assert stuck > 400
    assert at_delay >= 0.95 * stuck, (at_delay, stuck)  # 502 of 509
    assert extra <= 0.05 + 10 / 40_000
    # Rationing alone makes those that come due while the budget is short wait for the p99.
    stuck, at_delay, _ = _stuck_hedged_at_delay(suspicion=False)
    assert at_delay < 0.85 * stuck, (at_delay, stuck)  # 367 of 509


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantile": 1.0},
        {"window": 10, "min_samples": 20},
        {"min_delay_s": 2.0},
        {"quantile": 0.99, "late_quantile": 0.95},
    ],
)
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HedgePolicy(**kwargs)  # type: ignore[arg-type]


# --- budgets ------------------------------------------------------------------------------------


def test_the_hedge_budget_caps_hedges_at_five_percent_over_a_long_run() -> None:
    # Overload: every reply is slow, so every request would like a hedge.
    budget = HedgeBudget()
    requests = 100_000
    hedges = 0
    for _ in range(requests):
        budget.earn()
        hedges += budget.try_spend()
    assert hedges <= 0.05 * requests + budget.cap
    assert hedges == pytest.approx(0.05 * requests, rel=0.01)
    assert budget.spent == hedges and budget.refused == requests - hedges


def test_hedges_below_the_budget_all_go_out() -> None:
    rng = random.Random(8)
    budget = HedgeBudget()
    wanted = sent = 0
    for _ in range(50_000):
        budget.earn()
        if rng.random() < 0.02:  # 2% of replies are slow: well inside 5%
            wanted += 1
            sent += budget.try_spend()
    # Only the first few, before any tokens were earned, can be refused.
    assert wanted - sent <= 2
    assert wanted > 900


def test_a_burst_after_a_quiet_spell_is_limited_to_the_cap() -> None:
    budget = HedgeBudget(cap=10.0)
    for _ in range(10_000):
        budget.earn()  # 500 tokens' worth, but the bucket holds 10
    assert budget.tokens == pytest.approx(10.0)
    burst = 0
    while budget.try_spend():
        burst += 1
    assert burst == 10
    # From empty, the next copy needs twenty more requests.
    for _ in range(19):
        budget.earn()
        assert not budget.try_spend()
    budget.earn()
    assert budget.try_spend()


def test_the_budget_starts_empty_unless_told() -> None:
    assert not HedgeBudget().try_spend()
    seeded = HedgeBudget(initial=3.0)
    assert [seeded.try_spend() for _ in range(4)] == [True, True, True, False]
    assert HedgeBudget(initial=50.0).tokens == 10.0  # never above the cap


def test_the_retry_budget_allows_ten_percent() -> None:
    budget = RetryBudget()
    retries = 0
    for _ in range(10_000):
        budget.earn()
        retries += budget.try_spend()
    assert 990 <= retries <= 1_000 + budget.cap


def test_a_budget_of_nothing_allows_nothing() -> None:
    budget = TokenBudget(ratio=0.0)
    for _ in range(1_000):
        budget.earn()
    assert not budget.try_spend()


@pytest.mark.parametrize("kwargs", [{"ratio": -0.1}, {"ratio": 1.5}, {"ratio": 0.1, "cap": 0.5}])
def test_budget_settings_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TokenBudget(**kwargs)
