"""What a batch's compute cost against the best batch: batch efficiency and computational debt.

The cost model (engine/cost.py) prices a batch of ``n`` rows at ``fixed + per_row * n``, so a
row is cheapest in the largest batch the model may run (``N``, its ``max_batch_size``):
``best = fixed / N + per_row`` seconds a row. Against that price, for a batch of ``rows`` rows
that spent ``compute`` seconds in the runtime:

- **efficiency** = ``rows * best / compute``, at most 1: the rows served per second of
  compute, as a share of what the best batch serves per second;
- **debt** = ``compute - rows * best``, at least 0: the compute seconds spent beyond what the
  same rows would have cost at the best batch, so ``debt = compute * (1 - efficiency)``. A
  request carries its batch's debt in proportion to its rows.

Debt comes from small batches (the fixed part paid over few rows: too little traffic for the
batching delay, or a deadline that would not wait) and from batches slower than the cost model
expects (a noisy neighbour, a cold cache). Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchCost:
    efficiency: float  # 0..1
    debt_s: float  # the batch's, >= 0
    debts_s: tuple[float, ...]  # each member's share, by its rows


def batch_cost(
    rows: int, compute_s: float, best_s_per_row: float, rows_each: Sequence[int]
) -> BatchCost | None:
    """The batch's efficiency and debt, and each member's share; None where not known (no
    price yet, or a batch with no rows or no time)."""
    if best_s_per_row <= 0 or rows < 1 or not compute_s > 0:
        return None
    at_best = rows * best_s_per_row
    debt = max(0.0, compute_s - at_best)
    efficiency = min(1.0, at_best / compute_s)
    return BatchCost(efficiency, debt, tuple(debt * share / rows for share in rows_each))
