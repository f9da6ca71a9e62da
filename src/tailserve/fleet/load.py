"""What each serving worker carries, for the autoscaler: read from the front door's statistics
(HAProxy's ``show stat``), the workers' latency histograms and their CPU time.

- in flight: the requests HAProxy has sent the worker and those queued for it, over every
  backend that holds it;
- queue delay: the longest of HAProxy's recent mean queue times for it (over the last 1,024
  requests of each backend);
- p99: from the growth of the worker's ``tailserve_request_duration_seconds`` histogram since
  the last sample (None when fewer than 20 requests came in between);
- refusals: 503s the worker answered, plus those the front door's bounded queue answered
  itself, shared over the serving workers;
- CPU: cores used since the last sample, from ``/proc``.

The parsing and the arithmetic are pure; the caller fetches the texts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tailserve.fleet.autoscaler import WorkerLoad

LATENCY_FAMILY = "tailserve_request_duration_seconds"
# Fewer requests than this between two samples say nothing about a p99.
MIN_REQUESTS_FOR_P99 = 20


def parse_stat(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """HAProxy's ``show stat`` CSV as {(proxy, server): {column: value}}."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("# "):
        return {}
    columns = lines[0][2:].split(",")
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for line in lines[1:]:
        values = line.split(",")
        if len(values) < 2:
            continue
        rows[values[0], values[1]] = dict(zip(columns, values, strict=False))
    return rows


def carried(
    stat: Mapping[tuple[str, str], Mapping[str, str]], backends: Iterable[str], server: str
) -> int:
    """The requests the front door has in flight at ``server`` and queued for it, over
    ``backends``."""
    rows = [stat.get((backend, server), {}) for backend in backends]
    return sum(int(_number(row, "scur") + _number(row, "qcur")) for row in rows)


def histogram(page: str, family: str = LATENCY_FAMILY) -> dict[float, float]:
    """A Prometheus histogram's cumulative bucket counts, summed over its label sets."""
    prefix = f"{family}_bucket{{"
    counts: dict[float, float] = {}
    for line in page.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line.rpartition(" ")
        at = labels.find('le="')
        if at < 0:
            continue
        bound = labels[at + 4 : labels.index('"', at + 4)]
        le = math.inf if bound == "+Inf" else float(bound)
        counts[le] = counts.get(le, 0.0) + float(value)
    return counts


def quantile(before: Mapping[float, float], after: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of what a cumulative histogram gained between two samples, at the
    upper bound of the bucket it falls in (None: too few requests; +inf: past the last)."""
    bounds = sorted(after)
    grown = [after[b] - before.get(b, 0.0) for b in bounds]
    total = grown[-1] if grown else 0.0
    if total < MIN_REQUESTS_FOR_P99:
        return None
    wanted = q * total
    for bound, count in zip(bounds, grown, strict=True):
        if count >= wanted:
            return bound
    return math.inf


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU time of a process so far (None: gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class _Previous:
    at: float
    responses_5xx: float
    cpu_s: float | None
    latency: dict[float, float]


class LoadSampler:
    """Turns successive samples of the counters into each worker's recent load."""

    def __init__(self) -> None:
        self._previous: dict[str, _Previous] = {}
        self._denied: tuple[float, float] | None = None

    def sample(
        self,
        now: float,
        stat: Mapping[tuple[str, str], Mapping[str, str]],
        backends: Iterable[str],
        serving: Iterable[str],
        pages: Mapping[str, str | None],
        cpu: Mapping[str, float | None],
    ) -> dict[str, WorkerLoad]:
        """Each serving worker's load: ``stat`` parsed from ``show stat``, ``backends`` those
        that hold every worker, ``pages`` each worker's ``/metrics`` (None: not read)."""
        names = list(serving)
        backends = list(backends)
        denied = sum(_number(stat.get((b, "BACKEND"), {}), "dreq") for b in backends)
        shared = 0.0
        if self._denied is not None and now > self._denied[0]:
            shared = max(0.0, denied - self._denied[1]) / (now - self._denied[0])
        self._denied = (now, denied)
        loads = {}
        for name in names:
            rows = [stat.get((b, name), {}) for b in backends]
            in_flight = carried(stat, backends, name)
            queue_s = max((_number(r, "qtime") for r in rows), default=0.0) / 1e3
            errors = sum(_number(r, "hrsp_5xx") for r in rows)
            page = pages.get(name)
            latency = histogram(page) if page is not None else {}
            now_cpu = cpu.get(name)
            before = self._previous.get(name)
            p99 = refusals = used = None
            if before is not None and now > before.at:
                elapsed = now - before.at
                refusals = max(0.0, errors - before.responses_5xx) / elapsed
                if latency and before.latency:
                    p99 = quantile(before.latency, latency, 0.99)
                if now_cpu is not None and before.cpu_s is not None:
                    used = max(0.0, now_cpu - before.cpu_s) / elapsed
            self._previous[name] = _Previous(now, errors, now_cpu, latency or {})
            loads[name] = WorkerLoad(
                in_flight=in_flight,
                queue_delay_s=queue_s,
                p99_s=p99,
                refusals_per_s=(refusals or 0.0) + shared / max(1, len(names)),
                cpu=used or 0.0,
            )
        for gone in set(self._previous) - set(names):
            del self._previous[gone]
        return loads


def _number(row: Mapping[str, str], column: str) -> float:
    value = row.get(column, "")
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0
