"""h2load (nghttp2's C generator, Debian's `nghttp2-client`) as a gRPC unary load generator.

wrk2 speaks HTTP/1.1 only; h2load speaks HTTP/2, and a unary gRPC call is an HTTP/2 POST of one
framed message with ``content-type: application/grpc``. h2load sends the same body every time
(the benchmarks turn the result cache off, so each call is computed), ``--rps`` a connection
(open loop up to ``streams`` in flight on each), and logs every call's latency, from which the
percentiles come. Each connection sends at fixed intervals from when it was made: made all at
once, they send in step, as bursts of one call a connection (2,000 calls a second over 8
connections through the front door: p50 2.7 ms in step, 0.7 ms staggered). So they are made a
millisecond apart on each of its two threads (``-r 2 --rate-period 1ms``; wrk2 staggers its
connections too), which needs a count of calls (``-n``) in place of a duration: the calls of
the first ``warmup_s`` are left out of the figures. A gRPC error travels with HTTP status 200,
so h2load cannot see one: the errors of a run are its failed streams, its non-200 answers (the
front door's refusals) and the growth of the server's own count of gRPC calls answered with an
error (``/metrics``).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# tailserve_requests_total{model="churn",protocol="grpc",status="429"} 12.0 (any label order)
_GRPC_COUNT = re.compile(r"^tailserve_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.MULTILINE)
PATH = "/inference.GRPCInferenceService/ModelInfer"


def binary() -> str:
    found = shutil.which("h2load")
    if not found:
        raise SystemExit("h2load is not on the PATH: apt-get install nghttp2-client")
    return found


def framed(message: bytes) -> bytes:
    """A gRPC message as it travels: not compressed, its length, the message."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def infer_message(workload: Path, model_config: Path) -> bytes:
    """The first ``ModelInferRequest`` a `tailserve bench` workload would send over gRPC."""
    import yaml

    from tailserve.loadgen.plan import build_plan
    from tailserve.loadgen.workload import load_workload

    spec = load_workload(workload).with_overrides(protocol="grpc", duration_s=1.0, warmup_s=0.0)
    config = yaml.safe_load(model_config.read_text())
    return build_plan(spec, config, "127.0.0.1").requests[0]


def grpc_errors(metrics_url: str) -> float:
    """The gRPC calls the server (a worker, or the stack's merged page) answered with an error."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for labels, value in _GRPC_COUNT.findall(text):
        if 'protocol="grpc"' in labels and 'status="200"' not in labels:
            total += float(value)
    return total


@dataclass(frozen=True)
class Run:
    rate: float
    seconds: float
    answered: int  # HTTP 200s
    refused: int  # other HTTP statuses (the front door's refusals)
    failed: int  # streams that failed (no answer)
    grpc_errors: int  # answered with a gRPC error, by the server's count
    latencies_ms: np.ndarray  # of the 200s

    @property
    def errors(self) -> int:
        return self.refused + self.failed + self.grpc_errors

    def quantile(self, q: float) -> float:
        if not len(self.latencies_ms):
            return math.inf
        return float(np.quantile(self.latencies_ms, q))


def run(
    authority: str,
    message: bytes,
    rate: float,
    seconds: float,
    *,
    connections: int = 8,
    streams: int = 128,
    metrics_url: str = "",
    warmup_s: float = 1.0,
) -> Run:
    """``rate`` calls a second of ``message`` to ``authority`` (host:port) for ``seconds``."""
    connections = max(1, min(connections, int(rate)))
    per_connection = rate / connections
    before = grpc_errors(metrics_url) if metrics_url else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(framed(message))
        log = Path(tmp) / "log.tsv"
        command = [
            binary(),
            "-t2",  # (two threads, as wrk2 runs)
            f"-c{connections}",
            f"-m{streams}",
            f"--rps={per_connection:.3f}",
            f"-n{max(connections, round(rate * (seconds + warmup_s)))}",
            "-r2",  # (a connection a thread each millisecond)
            "--rate-period=1ms",
            "-d",
            str(body),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            f"--log-file={log}",
            f"http://{authority}{PATH}",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"h2load failed ({done.returncode}): {done.stderr.strip()}")
        rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    started = np.array([int(r[0]) for r in rows], dtype=np.int64)
    measured = started >= started.min() + warmup_s * 1e6 if len(rows) else started > 0
    statuses = np.array([int(r[1]) for r in rows], dtype=np.int64)[measured]
    micros = np.array([int(r[2]) for r in rows], dtype=np.int64)[measured]
    started = started[measured]
    # How long the measured calls took to send and answer: longer than ``seconds`` when the
    # calls in flight reached the limit and h2load sent the rest late (it measures each call
    # from when it went, so a late one's wait is not in its latency: the rate falls instead).
    if len(started):
        seconds = max(seconds, float((started + micros).max() - started.min()) / 1e6)
    after = grpc_errors(metrics_url) if metrics_url else 0.0
    return Run(
        rate=rate,
        seconds=seconds,
        answered=int((statuses == 200).sum()),
        refused=int(((statuses != 200) & (statuses != -1)).sum()),
        failed=int((statuses == -1).sum()),
        grpc_errors=round(after - before),
        latencies_ms=micros[statuses == 200] / 1000.0,
    )


def slo_capacity(
    authority: str,
    message: bytes,
    seconds: float,
    slo_ms: float,
    *,
    start_rps: float,
    metrics_url: str = "",
    in_flight: int = 64,
    connections: int = 8,
) -> float:
    """The highest rate of unary calls whose p99 stays within ``slo_ms`` with no error, searched
    run by run (each printed), as `_wrk2.slo_capacity` does over HTTP. At most ``in_flight``
    calls at once over ``connections`` (their streams split evenly), as wrk2's 64 connections
    hold at most 64 requests: with more, the front door's queue bound (48 a worker) refuses
    calls of bursts that HTTP's 64 connections cannot make, and the two protocols are no longer
    loaded alike. The shape matters: at a light load calls multiplexed on few connections wait
    longer, on any server (grpcio's C core at 2,000 calls a second: p50 0.66-0.83 ms over 8
    connections of 8 streams, 0.29-0.32 ms over 64 of one), while near capacity fewer
    connections cost the servers less a call and carry more."""
    from tailserve.loadgen.capacity import CapacitySearch, Step

    search = CapacitySearch(slo_ms, start_rps=start_rps, precision=0.1)
    while (rate := search.next_rate()) is not None:
        found = run(
            authority,
            message,
            rate,
            seconds,
            connections=connections,
            streams=max(1, in_flight // connections),
            metrics_url=metrics_url,
        )
        achieved = found.answered / found.seconds if found.seconds else 0.0
        print(
            f"  {rate:8.0f} req/s: p99 {found.quantile(0.99):8.2f} ms, errors {found.errors} "
            f"(refused {found.refused}, failed {found.failed}, gRPC {found.grpc_errors})"
        )
        search.record(Step(rate, achieved, found.quantile(0.99), found.errors))
    return search.capacity_rps or 0.0
