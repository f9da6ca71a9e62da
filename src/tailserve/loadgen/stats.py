"""A run's samples as the numbers people read: HDR percentiles, throughput, errors, timeline.

Latency percentiles come from HDR histograms (microsecond resolution, 3 significant figures)
of the measured requests, overall and per request class. A request counts in the latency
histogram when it succeeded, or when it timed out (at the time it waited: a stall must show in
the tail, not vanish into the error count); other failures count only as errors.

- ``offered_rps``: measured requests / measured window.
- ``achieved_rps``: successful measured requests / the time it took to answer them (the window,
  or longer when replies came after it: a server falling behind achieves less than offered).
- ``goodput_rps``: successful requests answered within the SLO / the window.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

from tailserve.loadgen.runner import Samples
from tailserve.loadgen.sending import CACHE_TIERS, ERROR_KINDS, TIMEOUT

Mask = np.ndarray[Any, np.dtype[np.bool_]]

_HIGHEST_US = 3_600_000_000
CDF_PERCENTILES = [round(100 * (1 - 10 ** (-k / 10)), 4) for k in range(41)]


def new_histogram() -> HdrHistogram:
    return HdrHistogram(1, _HIGHEST_US, 3)


def summarize(
    samples: Samples,
    *,
    class_names: list[str],
    warmup_s: float,
    end_s: float,
    slo_ms: float,
) -> dict[str, Any]:
    """The stats part of a result document (see `loadgen.report` for the whole)."""
    measured = (samples.intended >= warmup_s) & (samples.intended < end_s)
    window = max(end_s - warmup_s, 1e-9)
    overall, histogram = _stats(samples, measured, window, warmup_s, slo_ms)
    classes = {}
    for index, name in enumerate(class_names):
        chosen = measured & (samples.classes == index)
        if chosen.any():
            classes[name] = _stats(samples, chosen, window, warmup_s, slo_ms)[0]
    cdf = []
    if histogram.get_total_count():
        cdf = [[p, histogram.get_value_at_percentile(p) / 1000.0] for p in CDF_PERCENTILES]
    return {
        "overall": overall,
        "classes": classes,
        "server": server_account(samples, measured),
        "timeline": timeline(samples, end_s),
        "cdf": cdf,
    }


def _stats(
    samples: Samples, chosen: Mask, window: float, warmup_s: float, slo_ms: float
) -> tuple[dict[str, Any], HdrHistogram]:
    status = samples.status
    latency = samples.latency
    ok = chosen & (status >= 200) & (status < 400)
    timed_out = chosen & (status == TIMEOUT)
    histogram = new_histogram()
    for micros in np.maximum(1, (latency[ok | timed_out] * 1e6).astype(np.int64)).tolist():
        histogram.record_value(min(micros, _HIGHEST_US))
    count = int(chosen.sum())
    answered = int(ok.sum())
    within = int((ok & (latency * 1000.0 <= slo_ms)).sum())
    span = window
    if answered:
        span = max(window, float(np.nanmax(samples.done[ok])) - warmup_s)
    errors: dict[str, int] = {}
    for code in np.unique(status[chosen & ~ok]).tolist():
        kind = ERROR_KINDS.get(code, f"status_{code}")
        errors[kind] = errors.get(kind, 0) + int(((status == code) & chosen).sum())
    stats: dict[str, Any] = {
        "count": count,
        "ok": answered,
        "offered_rps": count / window,
        "achieved_rps": answered / span,
        "goodput_rps": within / window,
        "slo_misses": answered - within,
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
    }
    stats.update(percentiles(histogram))
    return stats, histogram


def percentiles(histogram: HdrHistogram) -> dict[str, float | None]:
    if not histogram.get_total_count():
        return {key: None for key in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")}
    at = histogram.get_value_at_percentile
    return {
        "p50_ms": at(50) / 1000.0,
        "p90_ms": at(90) / 1000.0,
        "p99_ms": at(99) / 1000.0,
        "p999_ms": at(99.9) / 1000.0,
        "max_ms": histogram.get_max_value() / 1000.0,
        "mean_ms": histogram.get_mean_value() / 1000.0,
    }


def server_account(samples: Samples, measured: Mask) -> dict[str, Any]:
    """What the server said of how it served the measured requests (where it said anything)."""
    account: dict[str, Any] = {}
    for field in ("queue_us", "compute_us"):
        values = getattr(samples, field)[measured]
        values = values[values >= 0]
        if len(values):
            name = field.removesuffix("_us")
            account[f"{name}_p50_ms"] = float(np.percentile(values, 50)) / 1000.0
            account[f"{name}_p99_ms"] = float(np.percentile(values, 99)) / 1000.0
    sizes = samples.batch_size[measured]
    sizes = sizes[sizes >= 0]
    if len(sizes):
        account["batch_size_mean"] = float(sizes.mean())
        account["batch_size_p50"] = float(np.percentile(sizes, 50))
    tiers = samples.cache[measured]
    if (tiers > 0).any():
        codes = np.unique(tiers[tiers > 0]).tolist()
        account["cache"] = {CACHE_TIERS[code]: int((tiers == code).sum()) for code in codes}
        # Each tier's own latency: the hit path apart from the misses that computed.
        latency_ms = samples.latency[measured] * 1000.0
        account["cache_latency_ms"] = {
            CACHE_TIERS[code]: {
                "p50": float(np.nanpercentile(latency_ms[tiers == code], 50)),
                "p99": float(np.nanpercentile(latency_ms[tiers == code], 99)),
            }
            for code in codes
        }
    return account


def timeline(samples: Samples, end_s: float, bin_s: float = 1.0) -> list[dict[str, Any]]:
    """Per second of the run: sent and completed per second, errors, p50 and p99 (ms)."""
    bins = max(1, math.ceil(end_s / bin_s))
    sent_bin = np.minimum((samples.intended // bin_s).astype(np.int64), bins - 1)
    done = samples.done[~np.isnan(samples.done)]
    done_bin = np.minimum((done // bin_s).astype(np.int64), bins - 1)
    sent = np.bincount(sent_bin, minlength=bins)
    completed = np.bincount(done_bin, minlength=bins)
    ok = (samples.status >= 200) & (samples.status < 400)
    errors = np.bincount(sent_bin[~ok], minlength=bins)
    latency_ms = samples.latency * 1000.0
    points = []
    for b in range(bins):
        width = min(bin_s, end_s - b * bin_s) if end_s > b * bin_s else bin_s  # the last is short
        chosen = latency_ms[(sent_bin == b) & ok]
        p50 = p99 = None
        if len(chosen):
            p50, p99 = (float(v) for v in np.percentile(chosen, [50, 99]))
        points.append(
            {
                "t": b * bin_s,
                "sent": float(sent[b] / width),
                "completed": float(completed[b] / width),
                "errors": int(errors[b]),
                "p50_ms": p50,
                "p99_ms": p99,
            }
        )
    return points


def generator_account(
    samples: Samples, *, slo_ms: float, cpu_s: float, wall_s: float, processes: int
) -> dict[str, Any]:
    """How well the generator kept its schedule, and what it cost."""
    lag = np.maximum(samples.dispatched - samples.intended, 0.0) * 1000.0
    lag = lag[~np.isnan(lag)]
    p50 = p99 = worst = 0.0
    if len(lag):
        p50, p99 = (float(v) for v in np.percentile(lag, [50, 99]))
        worst = float(lag.max())
    cpu_share = cpu_s / max(wall_s * processes, 1e-9)
    return {
        "processes": processes,
        "lag_p50_ms": p50,
        "lag_p99_ms": p99,
        "lag_max_ms": worst,
        # Behind: a hundredth of the requests went out later than a tenth of the SLO (at least
        # 5 ms), so the server saw less load than the schedule says.
        "behind": p99 > max(5.0, slo_ms / 10.0),
        "cpu_share": cpu_share,
        # Busy most of the time: the figures may be the generator's limit, not the server's.
        "cpu_bound": cpu_share > 0.9,
    }
