"""The dashboard's series: what the stack did between two scrapes of its ``/metrics``.

Pure: it takes the workers' Prometheus pages (already fetched) and the fleet's view, and gives
each interval's point per model. Rates and quantiles come from what the counters and histogram
buckets gained between two scrapes, each series on its own (a worker that restarted counts from
zero again, as Prometheus's ``increase`` takes a counter reset), then summed over the workers.
A quantile is interpolated linearly inside its bucket, as Prometheus's ``histogram_quantile``
does, so the page and a Grafana panel over the same series agree.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# (sample name, its labels sorted, the ``worker`` label among them)
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
Samples = Mapping[SeriesKey, float]

LATENCY = "tailserve_request_duration_seconds"
QUEUE = "tailserve_queue_duration_seconds"
REQUESTS = "tailserve_requests_total"
REFUSALS = "tailserve_rejected_requests_total"
CACHE_LOOKUPS = "tailserve_cache_lookups_total"
BATCH_ROWS = "tailserve_batch_size_rows"
EFFICIENCY = "tailserve_batch_efficiency_ratio"
DEBT = "tailserve_compute_debt_seconds"
HEDGES = "tailserve_router_hedges_total"
VARIANTS = "tailserve_variant_requests_total"
JOBS_FINISHED = "tailserve_jobs_finished_total"
JOBS_RUNNING = "tailserve_jobs_running"
SLO = "tailserve_model_slo_seconds"
# A cache lookup's results that the tier answered (the others are misses).
HIT = "hit"
# The samples the dashboard reads; the rest of a page is skipped unparsed.
WANTED = frozenset(
    (
        f"{LATENCY}_bucket",
        f"{QUEUE}_bucket",
        REQUESTS,
        REFUSALS,
        CACHE_LOOKUPS,
        f"{BATCH_ROWS}_sum",
        f"{BATCH_ROWS}_count",
        f"{EFFICIENCY}_sum",
        f"{EFFICIENCY}_count",
        f"{DEBT}_sum",
        HEDGES,
        VARIANTS,
        JOBS_FINISHED,
        JOBS_RUNNING,
        SLO,
    )
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_pages(
    pages: Iterable[tuple[str, str]], wanted: frozenset[str] = WANTED
) -> dict[SeriesKey, float]:
    """The ``wanted`` samples of Prometheus text pages (source name, page) as one mapping of
    series to value, each labelled with its ``worker`` (the source), as the stack's
    ``/metrics`` merges them. A line parser of the exposition format, not prometheus_client's:
    that one reads every family of every page, some 100 times slower, once a second."""
    samples: dict[SeriesKey, float] = {}
    for source, page in pages:
        for line in page.splitlines():
            if not line or line[0] == "#":
                continue
            brace = line.find("{")
            space = line.find(" ")
            if brace < 0 or 0 <= space < brace:
                name, labels, rest = line[:space], [], line[space:]
            else:
                name, close = line[:brace], line.rfind("}")
                if name not in wanted or close < 0:
                    continue
                labels = [(k, _unescape(v)) for k, v in _LABEL.findall(line, brace + 1, close)]
                rest = line[close + 1 :]
            if name not in wanted:
                continue
            value = rest.split()
            if not value:
                continue
            own = [(k, v) for k, v in labels if k != "worker"]
            pairs = tuple(sorted([*own, ("worker", source)]))
            samples[name, pairs] = float(value[0])
    return samples


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], value)


def increase(before: Samples, after: Samples) -> dict[SeriesKey, float]:
    """What each series gained from ``before`` to ``after``: a series new since ``before``
    from zero, one that went down (its process restarted) from zero again."""
    grown = {}
    for key, value in after.items():
        was = before.get(key, 0.0)
        grown[key] = value - was if value >= was else value
    return grown


def sum_by(
    samples: Samples,
    name: str,
    by: Sequence[str],
    where: Callable[[Mapping[str, str]], bool] | None = None,
) -> dict[tuple[str, ...], float]:
    """The values of the series called ``name`` summed by the labels ``by`` (a missing label
    counts as empty), over those ``where`` keeps."""
    sums: dict[tuple[str, ...], float] = {}
    for (sample, pairs), value in samples.items():
        if sample != name:
            continue
        labels = dict(pairs)
        if where is not None and not where(labels):
            continue
        group = tuple(labels.get(label, "") for label in by)
        sums[group] = sums.get(group, 0.0) + value
    return sums


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ({upper bound: count}), as Prometheus's
    ``histogram_quantile`` estimates it: linear inside the bucket the rank falls in, from the
    bucket below's bound (0 for the first); the last finite bound where it falls in +Inf.
    None where there is nothing to estimate from (no observations, no +Inf bucket)."""
    bounds = sorted(buckets)
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    counts: list[float] = []
    for bound in bounds:  # a count below the one before is a scrape race: keep it monotonic
        counts.append(max(buckets[bound], counts[-1] if counts else 0.0))
    total = counts[-1]
    if total <= 0:
        return None
    rank = min(max(q, 0.0), 1.0) * total
    b = next(i for i, count in enumerate(counts) if count >= rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    return start + (end - start) * (rank / count)


def buckets_by_model(samples: Samples, family: str) -> dict[str, dict[float, float]]:
    """A histogram family's cumulative buckets summed over everything but the model."""
    out: dict[str, dict[float, float]] = {}
    for (model, le), value in sum_by(samples, f"{family}_bucket", ("model", "le")).items():
        bound = math.inf if le == "+Inf" else float(le)
        counts = out.setdefault(model, {})
        counts[bound] = counts.get(bound, 0.0) + value
    return out


@dataclass(frozen=True, slots=True)
class ModelPoint:
    """One model over one interval (per second: over the interval's seconds)."""

    p50_s: float | None
    p99_s: float | None
    requests_per_s: float
    errors_per_s: float  # answered with a status of 500 or more
    refusals_per_s: dict[str, float]  # by reason
    cache_hit_ratio: dict[str, float | None]  # by tier: hits over lookups at that tier
    batch_rows_mean: float | None
    batch_efficiency: float | None  # rows a second of compute, as a share of the best batch's
    compute_debt_per_s: float | None
    queue_p99_s: float | None
    hedges_per_s: dict[str, float]  # by outcome (sent, won, ...)
    variants_per_s: dict[str, float]  # by the variant that ran
    jobs_finished_per_s: dict[str, float]  # by outcome
    slo_s: float | None


@dataclass(frozen=True, slots=True)
class Totals:
    """Counts since each worker started, summed over the workers, as ``/metrics`` has them."""

    requests: dict[str, float]  # by model, every status
    cache_hits: dict[str, float]  # by tier, every model
    cache_lookups: dict[str, float]  # by tier, every model
    refusals: dict[str, float]  # by reason, every model
    jobs_finished: dict[str, float]  # by outcome, every model
    jobs_running: float


@dataclass(frozen=True, slots=True)
class Point:
    """One sample of the dashboard: ``at`` (Unix seconds) closes an interval of
    ``interval_s`` (0 for the first sample, which has nothing to compare with)."""

    seq: int
    at: float
    interval_s: float
    models: dict[str, ModelPoint]
    totals: Totals
    workers: dict[str, int] = field(default_factory=dict)  # how many in each state


def totals(samples: Samples) -> Totals:
    def hits(labels: Mapping[str, str]) -> bool:
        return labels.get("result") == HIT

    return Totals(
        requests=_flat(samples, REQUESTS, "model"),
        cache_hits=_flat(samples, CACHE_LOOKUPS, "tier", hits),
        cache_lookups=_flat(samples, CACHE_LOOKUPS, "tier"),
        refusals=_flat(samples, REFUSALS, "reason"),
        jobs_finished=_flat(samples, JOBS_FINISHED, "outcome"),
        jobs_running=sum(sum_by(samples, JOBS_RUNNING, ()).values()),
    )


def model_points(
    grown: Samples, now: Samples, interval_s: float, slos_s: Mapping[str, float]
) -> dict[str, ModelPoint]:
    """Each model's point from what the series ``grown`` over ``interval_s`` seconds, with
    the SLO from the ``now`` gauge where the workers export it, else from ``slos_s``."""
    per_s = 1.0 / interval_s if interval_s > 0 else 0.0
    latency = buckets_by_model(grown, LATENCY)
    queue = buckets_by_model(grown, QUEUE)
    requests = sum_by(grown, REQUESTS, ("model", "status"))
    refusals = sum_by(grown, REFUSALS, ("model", "reason"))
    lookups = sum_by(grown, CACHE_LOOKUPS, ("model", "tier", "result"))
    rows_sum = sum_by(grown, f"{BATCH_ROWS}_sum", ("model",))
    rows_count = sum_by(grown, f"{BATCH_ROWS}_count", ("model",))
    efficiency_sum = sum_by(grown, f"{EFFICIENCY}_sum", ("model",))
    efficiency_count = sum_by(grown, f"{EFFICIENCY}_count", ("model",))
    debt = sum_by(grown, f"{DEBT}_sum", ("model",))
    hedges = sum_by(grown, HEDGES, ("model", "outcome"))
    variants = sum_by(grown, VARIANTS, ("model", "variant"))
    jobs = sum_by(grown, JOBS_FINISHED, ("model", "outcome"))
    # Each worker exports the same SLO gauge for a model it serves.
    exported: dict[str, float] = {}
    for (name, pairs), value in now.items():
        if name == SLO:
            model = dict(pairs).get("model", "")
            exported[model] = max(value, exported.get(model, value))
    models = {m for m, _ in requests} | set(latency) | {m for m, _ in refusals}
    models |= {m for m, _ in hedges} | {m for m, _ in jobs}
    models.discard("")

    def by(table: Mapping[tuple[str, ...], float], model: str) -> dict[str, float]:
        return {k[1]: v * per_s for k, v in sorted(table.items()) if k[0] == model}

    points = {}
    for model in sorted(models):
        tiers: dict[str, list[float]] = {}
        for (m, tier, result), n in lookups.items():
            if m == model:
                seen = tiers.setdefault(tier, [0.0, 0.0])
                seen[1] += n
                seen[0] += n if result == HIT else 0.0
        answered = {k[1]: v for k, v in requests.items() if k[0] == model}
        points[model] = ModelPoint(
            p50_s=histogram_quantile(0.5, latency.get(model, {})),
            p99_s=histogram_quantile(0.99, latency.get(model, {})),
            requests_per_s=sum(answered.values()) * per_s,
            errors_per_s=sum(v for s, v in answered.items() if s.startswith("5")) * per_s,
            refusals_per_s=by(refusals, model),
            cache_hit_ratio={t: hit / n if n else None for t, (hit, n) in sorted(tiers.items())},
            batch_rows_mean=_mean(rows_sum, rows_count, model),
            batch_efficiency=_mean(efficiency_sum, efficiency_count, model),
            compute_debt_per_s=debt[(model,)] * per_s if (model,) in debt else None,
            queue_p99_s=histogram_quantile(0.99, queue.get(model, {})),
            hedges_per_s=by(hedges, model),
            variants_per_s=by(variants, model),
            jobs_finished_per_s=by(jobs, model),
            slo_s=exported.get(model, slos_s.get(model)),
        )
    return points


def _flat(
    samples: Samples,
    name: str,
    label: str,
    where: Callable[[Mapping[str, str]], bool] | None = None,
) -> dict[str, float]:
    return {k[0]: v for k, v in sorted(sum_by(samples, name, (label,), where).items())}


def _mean(
    sums: Mapping[tuple[str, ...], float], counts: Mapping[tuple[str, ...], float], model: str
) -> float | None:
    count = counts.get((model,), 0.0)
    return sums.get((model,), 0.0) / count if count > 0 else None


class History:
    """The last ``keep`` points, each made from a scrape and the one before it."""

    def __init__(self, keep: int = 600) -> None:
        self._points: deque[Point] = deque(maxlen=keep)
        self._last: tuple[float, Samples] | None = None
        self._seq = 0

    def add(
        self,
        at: float,
        clock: float,
        samples: Samples,
        workers: Mapping[str, int],
        slos_s: Mapping[str, float],
    ) -> Point:
        """The point closing at ``at`` (Unix seconds; ``clock``: a monotonic clock's reading
        then) from the stack's ``samples``, its workers by state and the models' SLOs."""
        if self._last is None:
            interval_s, models = 0.0, {}
        else:
            interval_s = max(clock - self._last[0], 0.0)
            grown = increase(self._last[1], samples)
            models = model_points(grown, samples, interval_s, slos_s)
        self._last = clock, samples
        self._seq += 1
        point = Point(self._seq, at, interval_s, models, totals(samples), dict(workers))
        self._points.append(point)
        return point

    def since(self, seq: int) -> list[Point]:
        """The points kept that came after ``seq`` (0: all of them), oldest first."""
        return [point for point in self._points if point.seq > seq]

    @property
    def latest(self) -> int:
        return self._seq
