"""Choosing a replica: round-robin, power of two choices, bounded-load consistent hashing.

Seeded randomness throughout: every run sees the same streams.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from tailserve.router import (
    Backend,
    Balancer,
    BoundedLoadHash,
    Pool,
    PowerOfTwo,
    RoundRobin,
    make_balancer,
)
from tailserve.router.balancing import score, stable_hash

NOW = 100.0


def pool_of(count: int, *, max_in_flight: int = 1_000) -> Pool:
    return Pool("churn", [Backend(f"w{i}", max_in_flight=max_in_flight) for i in range(count)])


def balancers() -> list[Balancer]:
    return [RoundRobin(), PowerOfTwo(random.Random(1)), BoundedLoadHash(epsilon=0.25)]


def zipf_keys(rng: random.Random, count: int, *, keys: int = 1_000, s: float = 1.1) -> list[str]:
    weights = [1.0 / rank**s for rank in range(1, keys + 1)]
    return [f"key-{k}" for k in rng.choices(range(keys), weights=weights, k=count)]


# --- every balancer ---------------------------------------------------------------------------


@pytest.mark.parametrize("balancer", balancers(), ids=lambda b: type(b).__name__)
def test_every_replica_saturated_or_out_means_none(balancer: Balancer) -> None:
    pool = pool_of(3, max_in_flight=2)
    a, b, c = pool.backends
    a.in_flight = b.in_flight = 2
    c.healthy = False
    assert balancer.choose(pool, "k", NOW) is None
    assert balancer.choose(Pool("empty"), "k", NOW) is None
    b.in_flight = 1
    assert balancer.choose(pool, "k", NOW) is b


@pytest.mark.parametrize("balancer", balancers(), ids=lambda b: type(b).__name__)
def test_excluded_backends_are_not_chosen(balancer: Balancer) -> None:
    pool = pool_of(3)
    a, b, c = pool.backends
    for i in range(30):
        chosen = balancer.choose(pool, f"k{i}", NOW, exclude=(a, c))
        assert chosen is b
    assert balancer.choose(pool, "k", NOW, exclude=(a, b, c)) is None


# --- round-robin --------------------------------------------------------------------------------


def test_round_robin_cycles_in_the_pools_order_skipping_the_unavailable() -> None:
    pool = pool_of(4)
    a, b, c, d = pool.backends
    balancer = RoundRobin()
    assert [balancer.choose(pool, None, NOW) for _ in range(8)] == [a, b, c, d] * 2
    c.ejected_until = NOW + 1
    assert [balancer.choose(pool, None, NOW) for _ in range(6)] == [a, b, d] * 2


# --- power of two choices ----------------------------------------------------------------------


def test_p2c_prefers_the_less_loaded_of_two_equally_fast_replicas() -> None:
    pool = pool_of(2)
    busy, idle = pool.backends
    for backend in pool:
        backend.latency_s, backend.samples = 0.010, 10
    busy.in_flight = 3
    balancer = PowerOfTwo(random.Random(7))
    assert all(balancer.choose(pool, None, NOW) is idle for _ in range(50))


def test_p2c_prefers_the_faster_of_two_equally_loaded_replicas() -> None:
    pool = pool_of(2)
    slow, fast = pool.backends
    slow.latency_s, fast.latency_s = 0.050, 0.010
    slow.in_flight = fast.in_flight = 2
    balancer = PowerOfTwo(random.Random(7))
    assert all(balancer.choose(pool, None, NOW) is fast for _ in range(50))
    # ... but not at any price: a fast replica with a long queue loses to an idle slow one.
    fast.in_flight = 20  # (20 + 1) * 10 ms > (2 + 1) * 50 ms
    assert balancer.choose(pool, None, NOW) is slow


def test_p2c_stops_believing_a_latency_nobody_has_measured_for_a_while() -> None:
    # Light load, nothing in flight: a replica that once looked slower would never be chosen
    # again, and so never measured again, if its old average were believed for ever.
    pool = pool_of(2)
    slow, fast = pool.backends
    pool.start(slow)
    pool.finish(slow, 0.050, ok=True, now=NOW)
    pool.start(fast)
    pool.finish(fast, 0.010, ok=True, now=NOW)
    balancer = PowerOfTwo(random.Random(7))
    assert all(balancer.choose(pool, None, NOW + 1.0) is fast for _ in range(20))
    fast.sampled_at = NOW + 5.0  # the fast one keeps being measured; the slow one does not
    later = NOW + 5.0
    assert slow in {balancer.choose(pool, None, later) for _ in range(50)}


def test_p2c_score_is_the_expected_wait() -> None:
    backend = Backend("a", in_flight=3, latency_s=0.02)
    assert score(backend, prior_s=1.0) == pytest.approx(0.08)
    assert score(Backend("new", in_flight=1), prior_s=0.01) == pytest.approx(0.02)


def test_a_p2c_copy_goes_to_the_least_loaded_of_all_the_others() -> None:
    # A hedge is there to beat a late reply: two random picks would often both be busy.
    pool = pool_of(5)
    tried, busy1, busy2, idle1, idle2 = pool.backends
    for backend in pool:
        backend.latency_s, backend.samples = 0.010, 10
    tried.in_flight, busy1.in_flight, busy2.in_flight = 1, 2, 2
    balancer = PowerOfTwo(random.Random(5))
    copies = Counter(balancer.choose(pool, None, NOW, (tried,), copy=True) for _ in range(200))
    assert set(copies) == {idle1, idle2}  # ties broken at random, not always the first idle
    assert min(copies.values()) > 50
    # A first choice is two random picks, with the idle ones weighed in when both are busy:
    # it never queues behind a busy replica while one sits idle (at equal latency).
    firsts = Counter(balancer.choose(pool, None, NOW, (tried,)) for _ in range(200))
    assert set(firsts) == {idle1, idle2} and min(firsts.values()) > 50


def test_p2c_weighs_idle_replicas_only_when_both_picks_are_busy() -> None:
    pool = pool_of(4)
    for backend in pool:
        backend.latency_s, backend.samples = 0.010, 10
    a, b, c, d = pool.backends
    a.in_flight = b.in_flight = 1
    balancer = PowerOfTwo(random.Random(9))
    # Each request counts in flight at once: four in a row fill the idle ones first.
    chosen = []
    for _ in range(2):
        pick = balancer.choose(pool, None, NOW)
        assert pick in (c, d)
        pool.start(pick)
        chosen.append(pick)
    assert set(chosen) == {c, d}
    # Everyone busy: plain power of two choices again.
    spread = Counter(balancer.choose(pool, None, NOW) for _ in range(400))
    assert set(spread) == {a, b, c, d}


def test_an_idle_replica_far_slower_than_a_busy_one_does_not_win() -> None:
    pool = pool_of(3)
    busy, other_busy, idle_slow = pool.backends
    busy.latency_s = other_busy.latency_s = 0.010
    idle_slow.latency_s = 0.050  # 1 x 50 ms against (1 + 1) x 10 ms
    for backend in pool:
        backend.samples = 10
    busy.in_flight = other_busy.in_flight = 1
    balancer = PowerOfTwo(random.Random(4))
    picks = [balancer.choose(pool, None, NOW) for _ in range(100)]
    assert idle_slow not in picks
    idle_slow.latency_s = 0.015  # 15 ms < 20 ms: now it wins whenever both picks are busy
    assert all(balancer.choose(pool, None, NOW) is idle_slow for _ in range(100))


def test_p2c_spreads_load_evenly() -> None:
    pool = pool_of(10)
    balancer = PowerOfTwo(random.Random(3))
    for _ in range(1_000):
        chosen = balancer.choose(pool, None, NOW)
        assert chosen is not None
        pool.start(chosen)
    loads = sorted(b.in_flight for b in pool)
    # Two choices keep the gap to the mean at O(log log n): a few requests, not tens
    # (one random choice gives a spread of about ±3 sigma = ±28 here).
    assert loads[-1] - loads[0] <= 4, loads


def test_p2c_sends_a_slow_replica_its_fair_share_of_little() -> None:
    pool = pool_of(5)
    slow = pool.backends[0]
    for backend in pool:
        backend.latency_s = 0.010
    slow.latency_s = 0.100
    balancer = PowerOfTwo(random.Random(5))
    for _ in range(500):
        chosen = balancer.choose(pool, None, NOW)
        assert chosen is not None
        pool.start(chosen)
    fast_mean = sum(b.in_flight for b in pool.backends[1:]) / 4
    assert slow.in_flight < fast_mean / 3, (slow.in_flight, fast_mean)


def test_p2c_uses_a_replica_that_keeps_losing_to_hedges_only_as_overflow() -> None:
    # Its latency average looks like the others' (a stalled request loses to its hedge and is
    # withdrawn, so the stall is never measured whole); its share overtaken gives it away.
    pool = pool_of(4)
    for backend in pool:
        backend.latency_s, backend.sampled_at = 0.005, NOW
    stalling = pool.backends[0]
    for n in range(100):  # one in ten of its requests lost to a hedge; none of the others'
        for backend in pool:
            pool.overtaken(backend, lost=backend is stalling and n % 10 == 0)
    assert pool.suspect(stalling)
    balancer = PowerOfTwo(random.Random(5))
    # The others idle, or one request ahead on each: it is not chosen.
    for ahead in (0, 1):
        for backend in pool.backends[1:]:
            backend.in_flight = ahead
        assert stalling not in {balancer.choose(pool, None, NOW) for _ in range(200)}
        copies = {balancer.choose(pool, None, NOW, copy=True) for _ in range(50)}
        assert stalling not in copies
    # Three ahead on each of the others: it takes the overflow.
    for backend in pool.backends[1:]:
        backend.in_flight = 3
    assert stalling in {balancer.choose(pool, None, NOW) for _ in range(200)}
    # Once nothing has been heard from it for a while, it is tried again (it may have healed)...
    for backend in pool:
        backend.in_flight = 0
    later = NOW + 5.0
    for backend in pool.backends[1:]:
        backend.sampled_at = later
    assert stalling in {balancer.choose(pool, None, later) for _ in range(200)}
    # ... and answering first lifts the suspicion.
    while pool.suspect(stalling):
        pool.overtaken(stalling, lost=False)
    stalling.sampled_at = later
    chosen = Counter(balancer.choose(pool, None, later) for _ in range(400))
    assert chosen[stalling] > 50, chosen


# --- affinity: bounded-load consistent hashing --------------------------------------------------


def test_the_hash_is_stable_across_processes() -> None:
    # Pinned: a ring built by another router process (or after a restart) must agree.
    # (Python's hash() of a str changes with PYTHONHASHSEED from one process to the next.)
    assert stable_hash("churn:abc") == 0x3C1F5195DDFEDA38
    assert stable_hash("churn:abc") != stable_hash("churn:abd")


def test_equal_keys_go_to_the_same_replica_while_it_is_available() -> None:
    pool = pool_of(8)
    balancer = BoundedLoadHash()
    keys = [f"key-{i}" for i in range(200)]
    first = {key: balancer.choose(pool, key, NOW) for key in keys}
    for _ in range(3):
        for key in keys:
            assert balancer.choose(pool, key, NOW) is first[key]
    # A second balancer (another router process) agrees: the ring depends only on the ids.
    other = BoundedLoadHash()
    assert all(other.choose(pool, key, NOW) is first[key] for key in keys)
    # And the keys are spread over every replica.
    assert len({backend.id for backend in first.values() if backend}) == 8


def test_keys_spread_near_evenly_over_the_ring() -> None:
    pool = pool_of(10)
    balancer = BoundedLoadHash()
    counts = Counter(balancer.choose(pool, f"key-{i}", NOW) for i in range(20_000))
    shares = [count / 20_000 for count in counts.values()]
    assert len(shares) == 10
    assert min(shares) > 0.06 and max(shares) < 0.14, sorted(shares)


def mapping(balancer: BoundedLoadHash, pool: Pool, keys: list[str]) -> dict[str, str]:
    chosen = {key: balancer.choose(pool, key, NOW) for key in keys}
    return {key: backend.id for key, backend in chosen.items() if backend is not None}


def test_removing_a_replica_moves_only_its_own_keys() -> None:
    pool = pool_of(10)
    balancer = BoundedLoadHash()
    keys = [f"key-{i}" for i in range(10_000)]
    before = mapping(balancer, pool, keys)
    pool.remove("w3")
    after = mapping(balancer, pool, keys)
    moved = [key for key in keys if before[key] != after[key]]
    assert all(before[key] == "w3" for key in moved)
    assert len(moved) == sum(1 for key in keys if before[key] == "w3")
    # About a tenth of the keys: the removed replica's share, not a reshuffle.
    assert 0.06 < len(moved) / len(keys) < 0.14


@pytest.mark.parametrize("how", ["ejected", "unhealthy"])
def test_a_replica_out_of_service_moves_only_its_keys_and_gets_them_back(how: str) -> None:
    pool = pool_of(6)
    balancer = BoundedLoadHash()
    keys = [f"key-{i}" for i in range(3_000)]
    before = mapping(balancer, pool, keys)
    out = pool.get("w2")
    assert out is not None
    if how == "ejected":
        out.ejected_until = NOW + 5
    else:
        out.healthy = False
    during = mapping(balancer, pool, keys)
    assert "w2" not in during.values()
    assert all(before[key] == "w2" for key in keys if before[key] != during[key])
    out.ejected_until, out.healthy = None, True
    assert mapping(balancer, pool, keys) == before


def test_a_hedge_of_a_keyed_request_goes_to_the_next_replica_on_the_ring() -> None:
    pool = pool_of(5)
    balancer = BoundedLoadHash()
    order = list(balancer.order(pool, "hot"))
    assert sorted(b.id for b in order) == sorted(pool.ids)
    assert balancer.choose(pool, "hot", NOW) is order[0]
    assert balancer.choose(pool, "hot", NOW, exclude=(order[0],)) is order[1]


def test_bounded_loads_hold_on_a_skewed_key_stream() -> None:
    epsilon, count = 0.25, 8
    rng = random.Random(11)
    keys = zipf_keys(rng, 20_000)
    pool = pool_of(count)
    balancer = BoundedLoadHash(epsilon=epsilon)
    in_flight: list[Backend] = []
    homes: dict[str, set[str]] = {}
    worst = 0.0
    for key in keys:
        # Keep about 64 requests in flight; replies come back in random order.
        while len(in_flight) >= 64 or (in_flight and rng.random() < 0.3):
            done = in_flight.pop(rng.randrange(len(in_flight)))
            pool.finish(done, 0.01, ok=True)
        chosen = balancer.choose(pool, key, NOW)
        assert chosen is not None
        pool.start(chosen)
        in_flight.append(chosen)
        homes.setdefault(key, set()).add(chosen.id)
        # Only the chosen replica's load grew: placing the request kept it within the bound.
        # (A replica may sit above a bound that fell as other requests finished; the bound is
        # on where new requests go, nothing is moved.)
        bound = math.ceil((1 + epsilon) * pool.in_flight / count)
        assert chosen.in_flight <= bound
        worst = max(worst, chosen.in_flight / (pool.in_flight / count))
    # The hottest key (about a seventh of the stream) spilled over to other replicas...
    assert len(homes["key-0"]) >= 2
    # ... while a rare key kept its single home.
    rare = [key for key, seen in Counter(keys).items() if seen == 1]
    assert all(len(homes[key]) == 1 for key in rare)
    assert worst > 1.0  # the bound was reached, not merely never approached


def test_without_the_bound_the_same_stream_overloads_the_hot_keys_replica() -> None:
    # The control for the test above: the same stream, an effectively unbounded ε.
    rng = random.Random(11)
    keys = zipf_keys(rng, 20_000)
    pool = pool_of(8)
    balancer = BoundedLoadHash(epsilon=1_000.0)
    in_flight: list[Backend] = []
    peak = 0.0
    for key in keys:
        while len(in_flight) >= 64 or (in_flight and rng.random() < 0.3):
            pool.finish(in_flight.pop(rng.randrange(len(in_flight))), 0.01, ok=True)
        chosen = balancer.choose(pool, key, NOW)
        assert chosen is not None
        pool.start(chosen)
        in_flight.append(chosen)
        peak = max(peak, chosen.in_flight / (pool.in_flight / 8))
    assert peak > 1.25 * 2


def test_the_bound_counts_the_request_being_placed() -> None:
    pool = pool_of(2)
    balancer = BoundedLoadHash(epsilon=0.25)
    assert balancer.bound(pool, NOW) == 1  # ceil(1.25 * 1 / 2)
    pool.backends[0].in_flight = 3
    pool.backends[1].in_flight = 4
    assert balancer.bound(pool, NOW) == 5  # ceil(1.25 * 8 / 2) = 5 exactly, not 6


def test_with_unequal_limits_a_replica_with_room_serves_rather_than_shedding() -> None:
    small, large = Backend("small", max_in_flight=1), Backend("large", max_in_flight=100)
    pool = Pool("churn", [small, large])
    small.in_flight, large.in_flight = 1, 10
    # Bound: ceil(1.25 * 12 / 2) = 8 < 11, yet `large` has room: it takes the request.
    assert BoundedLoadHash().choose(pool, "k", NOW) is large


def test_a_request_without_a_key_is_balanced_on_load() -> None:
    pool = pool_of(2)
    busy, idle = pool.backends
    busy.in_flight = 5
    balancer = BoundedLoadHash(fallback=PowerOfTwo(random.Random(2)))
    assert all(balancer.choose(pool, None, NOW) is idle for _ in range(20))


def test_make_balancer_by_name() -> None:
    assert isinstance(make_balancer("affinity", epsilon=0.5), BoundedLoadHash)
    assert isinstance(make_balancer("p2c", rng=random.Random(1)), PowerOfTwo)
    assert isinstance(make_balancer("round-robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown balancer 'random'"):
        make_balancer("random")
