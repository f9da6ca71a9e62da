"""Warm a worker's caches from a recorded trace: replay the most frequent requests once each.

A trace (``--trace-file``, see `observability/trace_log.py`) holds one line per sampled request.
Requests are the same when their method, path, body and the headers that shape the answer
(content type, binary header length, affinity key) are; deadlines, priorities and cache modes
are left out, and not sent (a warming request asks nothing special). The ``top`` most frequent
go to the target, at most ``concurrency`` at a time, so the worker computes each (or finds it in
Redis) and fills its L1 and Redis. The report counts how the worker answered by its ``x-cache``
header: from the cache already (l1, l2, precomputed, stale) or computed, and the errors.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tailserve.errors import ConfigError, UpstreamError
from tailserve.transport.http1 import Pool, frame_request

# Headers that change what a request means, so they tell requests apart and are sent again.
IDENTITY_HEADERS = ("content-type", "inference-header-content-length", "x-affinity-key")
FROM_CACHE = frozenset({"l1", "l2", "precomputed", "stale"})


@dataclass(frozen=True, slots=True)
class Recorded:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def digest(self) -> bytes:
        hasher = hashlib.blake2b(digest_size=16)
        for part in (self.method, self.path, *(f"{k}:{v}" for k, v in self.headers)):
            hasher.update(len(part).to_bytes(8, "little") + part.encode())
        hasher.update(self.body)
        return hasher.digest()


@dataclass(frozen=True, slots=True)
class Ranked:
    """The most frequent distinct requests of a trace, most frequent first."""

    requests: list[tuple[Recorded, int]]
    recorded: int  # requests in the trace
    distinct: int


@dataclass(slots=True)
class WarmReport:
    ranked: Ranked
    target: str
    sent: int = 0
    sources: Counter[str] = field(default_factory=Counter)  # x-cache of each answer
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    @property
    def from_cache(self) -> int:
        return sum(n for source, n in self.sources.items() if source in FROM_CACHE)

    @property
    def computed(self) -> int:
        return sum(n for source, n in self.sources.items() if source not in FROM_CACHE)


def read_requests(path: Path) -> Iterator[Recorded]:
    """The trace's requests in file order; a line that is not a trace line is an error naming
    it. Read as a stream, so a long trace never has to fit in memory."""
    try:
        source = path.open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    with source:
        for number, raw in enumerate(source, start=1):
            if not raw.strip():
                continue
            try:
                line = orjson.loads(raw)
                headers = {str(k).lower(): str(v) for k, v in line.get("headers", {}).items()}
                yield Recorded(
                    method=str(line["method"]),
                    path=str(line["path"]),
                    headers=tuple(
                        (name, headers[name]) for name in IDENTITY_HEADERS if name in headers
                    ),
                    body=base64.b64decode(line["body"], validate=True),
                )
            except (orjson.JSONDecodeError, KeyError, ValueError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{path}:{number}: not a trace line: {exc}") from None


def rank(path: Path, top: int) -> Ranked:
    """Count identical requests (first pass, digests only), then fetch the ``top`` most frequent
    (second pass); ties keep the order of first appearance."""
    counts: Counter[bytes] = Counter()
    for request in read_requests(path):
        counts[request.digest()] += 1
    chosen = dict(counts.most_common(top))
    found: dict[bytes, Recorded] = {}
    for request in read_requests(path):
        digest = request.digest()
        if digest in chosen and digest not in found:
            found[digest] = request
            if len(found) == len(chosen):
                break
    ranked = [(found[digest], count) for digest, count in chosen.items()]
    return Ranked(ranked, recorded=sum(counts.values()), distinct=len(counts))


def parse_target(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http":
        raise ConfigError(f"target {url!r}: only http:// targets are supported")
    if not parts.hostname:
        raise ConfigError(f"target {url!r} names no host")
    return parts.hostname, parts.port or 80


async def warm(
    trace: Path, target: str, *, top: int = 1000, concurrency: int = 8, timeout_s: float = 30.0
) -> WarmReport:
    if top < 1:
        raise ConfigError("--top must be >= 1")
    if concurrency < 1:
        raise ConfigError("--concurrency must be >= 1")
    host, port = parse_target(target)
    ranked = rank(trace, top)
    report = WarmReport(ranked, f"http://{host}:{port}")
    pool = Pool(host, port, max_connections=concurrency)
    queue = iter(ranked.requests)
    origin = f"{host}:{port}"

    async def replay() -> None:
        # The requests are taken in rank order by `concurrency` of these, one at a time each.
        for request, _ in queue:
            data = frame_request(
                request.method, request.path, origin, request.body, request.headers
            )
            report.sent += 1
            try:
                response = await pool.request(data, timeout_s)
            except UpstreamError as exc:
                _failed(report, request, exc.message)
                continue
            if response.status != 200:
                text = response.body[:200].decode("utf-8", "replace")
                _failed(report, request, f"HTTP {response.status}: {text}")
                continue
            source = response.header(b"x-cache")
            report.sources[source.decode("latin-1") if source is not None else "none"] += 1

    try:
        await asyncio.gather(*(replay() for _ in range(min(concurrency, len(ranked.requests)))))
    finally:
        await pool.close()
    return report


def _failed(report: WarmReport, request: Recorded, reason: str) -> None:
    report.errors += 1
    if len(report.error_samples) < 5:
        report.error_samples.append(f"{request.method} {request.path}: {reason}")


def summary(report: WarmReport) -> str:
    ranked = report.ranked
    covered = sum(count for _, count in ranked.requests)
    share = covered / ranked.recorded if ranked.recorded else 0.0
    sources = ", ".join(f"{name} {n:,}" for name, n in sorted(report.sources.items()))
    return (
        f"warm {report.target}: {ranked.recorded:,} recorded requests, {ranked.distinct:,} "
        f"distinct; replayed the top {len(ranked.requests):,} ({covered:,} of the recorded, "
        f"{share:.0%})\n"
        f"sent {report.sent:,}: {report.from_cache:,} answered from the cache already, "
        f"{report.computed:,} computed, {report.errors:,} errors"
        + (f" (x-cache: {sources})" if sources else "")
    )
