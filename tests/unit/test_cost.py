"""The online cost model: it converges on a known cost function and follows a change in it."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.engine.cost import LinearCost


def feed(cost: LinearCost, fixed: float, per_row: float, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for rows in rng.integers(1, 257, size=n).tolist():
        noise = rng.normal(0.0, 0.02)  # 2% timing noise
        cost.observe(rows, (fixed + per_row * rows) * (1 + noise))


def test_converges_on_a_linear_cost() -> None:
    cost = LinearCost()
    feed(cost, 0.002, 0.00001, 300)
    assert cost.fixed_s == pytest.approx(0.002, rel=0.15)
    assert cost.per_row_s == pytest.approx(0.00001, rel=0.1)
    assert cost.predict(128) == pytest.approx(0.002 + 0.00128, rel=0.05)
    assert cost.bound(128) > cost.predict(128)
    assert cost.error_s < 0.0002


def test_follows_a_change_in_the_cost() -> None:
    cost = LinearCost()
    feed(cost, 0.002, 0.00001, 300)
    feed(cost, 0.004, 0.00003, 150, seed=1)  # a slower neighbour, a new version...
    assert cost.predict(200) == pytest.approx(0.004 + 0.006, rel=0.08)


def test_steady_full_batches_are_predicted_and_the_fit_stays_sane() -> None:
    cost = LinearCost()
    feed(cost, 0.001, 0.00002, 200)
    for _ in range(300):  # steady load: every batch full, and now a little slower
        cost.observe(256, 0.001 + 0.00002 * 256 + 0.002)
    # Which part grew is ambiguous from one size; the size that runs is predicted well.
    assert cost.predict(256) == pytest.approx(0.0081, rel=0.03)
    assert cost.fixed_s >= 0 and cost.per_row_s >= 0
    assert cost.predict(1) < cost.predict(256)


def test_one_batch_size_from_the_start_moves_only_the_fixed_part() -> None:
    cost = LinearCost.with_prior(0.001, 0.00002)
    for _ in range(50):
        cost.observe(64, 0.004)
    assert cost.per_row_s == pytest.approx(0.00002)
    assert cost.predict(64) == pytest.approx(0.004)


def test_costs_that_do_not_grow_with_rows_fit_a_constant() -> None:
    cost = LinearCost()
    for rows in (1, 16, 64, 256) * 20:
        cost.observe(rows, 0.0013)
    assert cost.per_row_s == pytest.approx(0.0, abs=1e-9)
    assert cost.predict(1) == pytest.approx(0.0013)
    assert cost.predict(256) == pytest.approx(0.0013)


def test_a_prior_is_used_until_data_arrives_and_bad_values_are_ignored() -> None:
    cost = LinearCost.with_prior(0.003, 0.0001)
    assert cost.predict(10) == pytest.approx(0.004)
    cost.observe(10, float("nan"))
    cost.observe(0, 1.0)
    assert cost.observations == 0
    cost.observe(10, 0.008)
    assert cost.predict(10) == pytest.approx(0.008)


def test_one_wild_observation_does_not_blow_the_margin_up() -> None:
    cost = LinearCost()
    for _ in range(20):
        cost.observe(1, 0.002)
    cost.observe(64, 0.400)  # a first big batch paying for its allocations
    assert cost.error_s < 0.003
    assert cost.bound(1) < 0.010


def test_one_cold_large_batch_does_not_price_the_small_ones() -> None:
    # A class seeded by a cold 64-row warm-up run (1.1 s; warm it takes 0.18 s), then only
    # lone requests at 2.3 ms: the fit must price them at what they take where they are,
    # not by the line through the origin that the one big, old batch dictates.
    cost = LinearCost()
    cost.observe(64, 1.115)
    for _ in range(40):
        cost.observe(1, 0.0023)
    assert cost.predict(1) == pytest.approx(0.0023, rel=0.5)
