"""Which measured variants model.yaml keeps, and in what order the worker prefers them.

Kept by default: the full model (``fp32``); every variant this run made that is at least
`MIN_SPEEDUP` times as fast as ``fp32`` at some measured batch size; every variant model.yaml
already had that this run did not make. ``fp32-opt`` (the same arithmetic, graph-optimised)
takes ``fp32``'s place when it is kept and at least as accurate. An explicit list replaces the
rule. Order: the most accurate first (for ``max_abs_error``, the smallest error), ties broken
by speed (the geometric mean of the latencies over the batch sizes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tailserve.errors import ConfigError
from tailserve.modelconfig import Metric, Variant
from tailserve.optimize.accuracy import higher_is_better
from tailserve.optimize.candidates import BASELINE, GRAPH, NAMES

MIN_SPEEDUP = 1.1
GRAPH_OPTIMISED = NAMES[GRAPH]
# Accuracies are compared (and written) to this many decimals: closer is a tie, settled by speed.
DECIMALS = 6


@dataclass(frozen=True, slots=True)
class Result:
    """A variant with its measurements (accuracy, latency_ms, size_bytes) filled in."""

    variant: Variant
    made: bool
    note: str = ""
    kept: bool = False

    @property
    def name(self) -> str:
        return self.variant.name


def speedups(result: Result, baseline: Result) -> dict[int, float]:
    """By batch size: how many times as fast as the baseline (its latency over this one's)."""
    return {
        size: baseline.variant.latency_ms[size] / ms
        for size, ms in result.variant.latency_ms.items()
        if ms > 0 and size in baseline.variant.latency_ms
    }


def choose(results: Sequence[Result], metric: Metric, keep: Sequence[str] | None) -> list[Result]:
    """Every result, ordered by preference, each marked kept or not."""
    by_name = {result.name: result for result in results}
    if keep is not None:
        unknown = [name for name in keep if name not in by_name]
        if unknown:
            raise ConfigError(
                f"--keep: no variant {unknown[0]!r} was measured (measured: {', '.join(by_name)})"
            )
        if not keep:
            raise ConfigError("--keep: name at least one variant")
        kept = set(keep)
    else:
        kept = default_keep(results, metric)
    marked = [replace(result, kept=result.name in kept) for result in results]
    return order(marked, metric)


def default_keep(results: Sequence[Result], metric: Metric) -> set[str]:
    baseline = next(result for result in results if result.name == BASELINE)
    kept = {BASELINE}
    for result in results:
        faster = any(ratio >= MIN_SPEEDUP for ratio in speedups(result, baseline).values())
        if not result.made or faster:
            kept.add(result.name)
    optimised = next((result for result in results if result.name == GRAPH_OPTIMISED), None)
    if (
        optimised is not None
        and optimised.name in kept
        and _rank(optimised, metric) <= _rank(baseline, metric)
    ):
        kept.discard(BASELINE)
    return kept


def order(results: Sequence[Result], metric: Metric) -> list[Result]:
    return sorted(results, key=lambda result: (_rank(result, metric), _pace(result)))


def _rank(result: Result, metric: Metric) -> float:
    """The sort key of its accuracy: smaller is better; unmeasured (NaN) last."""
    accuracy = result.variant.accuracy
    if accuracy is None or math.isnan(accuracy):
        return math.inf
    rounded = round(accuracy, DECIMALS)
    return -rounded if higher_is_better(metric) else rounded


def _pace(result: Result) -> float:
    latencies = [ms for ms in result.variant.latency_ms.values() if ms > 0]
    if not latencies:
        return math.inf
    return math.exp(sum(math.log(ms) for ms in latencies) / len(latencies))
