"""Which form of a model serves a request: latency as a dial.

A model may come in variants (model.yaml's ``variants``): the full model, a quantised one, a
smaller one, the most accurate first. Each request is served by the most accurate variant that
the load allows and that meets its deadline given the queue now:

1. *The load.* Every request the model must compute adds what it would cost on the most
   accurate variant (its rows at the batch size the model now runs, seconds) to a decayed
   rate: the demand, in seconds of the instances' time a second. While the demand fits the
   instances' ``target_utilization`` of the time the event loop leaves them, every request
   gets the first variant. The loop and the instances share the worker's cores: where the
   loop is the bottleneck (late, or its thread busy), the model's instances are not idle
   capacity but CPU the loop needs, and a cheaper variant gives it back. So the capacity
   shrinks as the loop's pressure grows (`loop_pressure`), to nothing at saturation. Past the
   capacity, requests are split between the two neighbouring variants whose mix fits, in the
   proportion that fits exactly (the most accuracy the instances can afford); past what the
   cheapest can do, all get the cheapest, and admission refuses what even it cannot serve in
   time. The split is a running credit, not a coin: at a share of 0.3, three in every ten.
2. *The queue now.* The chosen variant is offered to the batcher, which admits it only while
   the work queued ahead leaves it a share of its time: of the n variants worth choosing, the
   k-th most accurate may take k/n of what admission allows (with two, the full model only
   while the queue ahead takes under half). Refused, the request is offered the next cheaper
   variant, and so on; only the last refusal counts as one. So a burst is answered by the full
   model until the queue is half-full, then by the cheaper ones, which still find room: under
   overload the cheaper variant comes before a refusal.

A variant that measures no cheaper than a more accurate one for the request (by at least
`_CHEAPER`: a tenth) is never chosen: it would trade accuracy for nothing, or for noise. The
demand is counted in the first variant's costs whatever served, so what is chosen does not feed
back into what is measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tailserve.engine.queues import ArrivalRate

# The batch size assumed before the model has run any (and the least the average may fall to).
_MIN_ROWS = 1.0
# A variant is worth choosing only if it costs at most this share of every more accurate one's
# (`tailserve optimize` keeps a variant at least 1.1x as fast, likewise).
_CHEAPER = 0.9
# How fast the average batch size follows the batches run (per batch).
_ROWS_ALPHA = 0.05
# The worker's pressure: none below the first figure, whole at the second. The event loop's lag
# (how late it runs what is ready, seconds), how busy its thread is (CPU over wall time), and
# how little of the machine's CPU is idle: where the worker's threads share the cores with each
# other and with other processes, each waits its turn and reads neither late nor busy while
# requests queue in front of the worker; no idle CPU is what shows it.
_LAG_S = (0.001, 0.004)
_BUSY = (0.5, 0.8)
_IDLE = (0.15, 0.02)


def loop_pressure(lag_s: float, busy: float, host_idle: float = 1.0) -> float:
    """How saturated the worker is, 0..1: the largest of its event loop's lag's, its loop
    thread's busyness's and the machine's want of idle CPU's."""

    def scaled(value: float, span: tuple[float, float]) -> float:
        return min(1.0, max(0.0, (value - span[0]) / (span[1] - span[0])))

    return max(scaled(lag_s, _LAG_S), scaled(busy, _BUSY), scaled(host_idle, _IDLE))


@dataclass(slots=True)
class VariantChooser:
    """The dial's policy for one served version; pure (it is told the time and the costs)."""

    names: Sequence[str]
    instances: int = 1
    target_utilization: float = 0.8
    demand: ArrivalRate = field(default_factory=ArrivalRate)
    # Rows a batch of this model has held lately (moving average): costs are taken per row at
    # that size, so the fixed part of a batch is shared as the batches share it now.
    batch_rows: float = _MIN_ROWS
    _credit: float = 0.0

    def __len__(self) -> int:
        return len(self.names)

    def batched(self, rows: int) -> None:
        """A batch of ``rows`` ran (any variant)."""
        self.batch_rows += _ROWS_ALPHA * (rows - self.batch_rows)

    def order(
        self, now: float, costs: Sequence[float], pressure: float = 0.0
    ) -> list[tuple[int, float]]:
        """The variants to offer a request to, in turn, each with the share of admission's
        allowance it may take of the queue (see above). ``costs``: what the request would cost
        on each variant (seconds, per row at the current batch size times its rows);
        ``pressure``: the event loop's (`loop_pressure`)."""
        frontier = _frontier(costs)
        tiers = len(frontier)
        offers = [(index, (rank + 1) / tiers) for rank, index in enumerate(frontier)]
        if tiers == 1:
            return offers
        first = costs[0]
        self.demand.add(now, first)  # (a float count: seconds, not rows)
        demand = self.demand.value(now)
        capacity = self.target_utilization * self.instances * (1.0 - pressure)
        if demand <= capacity or first <= 0:
            return offers
        # The cost a request may have on average, in units of the first variant's.
        allowed = capacity / demand
        ratios = [costs[v] / first for v in frontier]
        for at in range(len(frontier) - 1):
            upper, lower = ratios[at], ratios[at + 1]
            if lower <= allowed < upper:
                share = (allowed - lower) / (upper - lower)  # of the more accurate one
                self._credit += share
                if self._credit >= 1.0:
                    self._credit -= 1.0
                    return offers[at:]
                return offers[at + 1 :]
        return offers[-1:]


def _frontier(costs: Sequence[float]) -> list[int]:
    """The variants worth choosing: each cheaper than every more accurate one, by `_CHEAPER`."""
    chosen: list[int] = []
    cheapest = math.inf
    for index, cost in enumerate(costs):
        if cost < cheapest * _CHEAPER:
            chosen.append(index)
            cheapest = cost
    return chosen
