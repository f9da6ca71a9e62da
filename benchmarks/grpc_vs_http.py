"""The wire protocols side by side in one run: OIP v2 over HTTP (JSON, binary) and over gRPC
(unary calls, bidirectional streams), for churn and sentiment, direct to one worker and through
the stack (`tailserve up`: HAProxy's HTTP and gRPC front doors before the workers).

For each model, place and protocol, `tailserve bench` (open loop: each latency from its
request's intended send time) measures:

- SLO capacity: `tailserve bench --find-capacity` (p99 within the workload's SLO, churn 50 ms,
  sentiment 100 ms; no errors; the server keeping up). The bench is the generator of every row:
  wrk2 cannot speak gRPC, and no C generator here speaks its streams, so every row carries the
  same Python generator and its CPU share is printed beside it (one near a whole core may be
  the limit, not the server). With ``--wrk2`` (wrk2 on the PATH, WRK2=..., or
  /work/tools/wrk2), wrk2's own search over HTTP/JSON is printed as a cross-check; with
  ``--h2load`` (Debian's nghttp2-client), h2load's over gRPC unary calls (`_h2load`: a unary
  call is an HTTP/2 POST, which h2load sends open loop at a rate).
- p50 at concurrency 1: requests at a constant ``--idle-rate`` (one every 50 ms at 20 a second,
  each answered long before the next leaves), so one is in flight at a time.
- CPU a request: the workers' CPU time (user + system, all threads, from /proc) over a run at
  one rate for every protocol of a model (``--cpu-rate``, else churn 400, sentiment 150 a
  second), divided by the requests sent; through the stack the front door's (HAProxy's worker
  process) beside it.

Each model is served alone in the worker's repository with its result cache off and no variants
(every request computed by the full model) and is sent unique inputs: churn's single rows,
sentiment's reviews of skewed lengths. gRPC sends inputs raw (``raw_input_contents``) as the
binary HTTP extension does. Streams: ``--streams`` a generator process; through the stack each
stream stays on the worker HAProxy gave it, so give at least as many as ``--workers``.

    python benchmarks/grpc_vs_http.py [--models churn,sentiment] [--via worker,stack]
        [--step-s 10] [--rounds 1] [--workers 2] [--streams 4] [--wrk2] [--h2load] [--out DIR]

Prints a table a model and place, each figure with its ratio to HTTP/JSON, and writes them all
(medians over ``--rounds``, which alternate the protocols' order) to DIR/protocols.json beside
every bench result. Check with `ps` that nothing else runs; a smoke run:
``--step-s 1 --warmup-s 0.5 --idle-s 2 --cpu-s 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

import _harness as h

PROTOCOLS = {
    "http-json": "v2-json",
    "http-binary": "v2-binary",
    "grpc-unary": "grpc",
    "grpc-stream": "grpc-stream",
}


@dataclass(frozen=True)
class Model:
    workload: str  # shipped under benchmarks/workloads
    start_rps: float  # the capacity search's first step
    cpu_rps: float  # the rate at which each protocol's CPU a request is measured
    wrk2_script: str  # its name in _wrk2


MODELS = {
    "churn": Model("churn-unique.yaml", 500.0, 400.0, "SCRIPT"),
    "sentiment": Model("sentiment-skewed.yaml", 200.0, 150.0, "SENTIMENT"),
}


@dataclass(frozen=True)
class Place:
    name: str  # "worker" | "stack"
    http: str  # http://127.0.0.1:PORT
    grpc: str  # 127.0.0.1:PORT
    workers: Callable[[], list[int]]  # the worker processes' pids
    hop: Callable[[], int | None]  # the front door's process, if any


@contextlib.contextmanager
def lone_worker(repository: Path) -> Iterator[Place]:
    http, grpc = h.free_port(), h.free_port()
    command = h.worker(repository, http, "--grpc-port", str(grpc))
    with h.server_process(command, http) as (url, process):
        yield Place("worker", url, f"127.0.0.1:{grpc}", lambda: [process.pid], lambda: None)


@contextlib.contextmanager
def stack(repository: Path, workers: int) -> Iterator[Place]:
    grpc = h.free_port()
    # (up_stack turns gRPC off; the later flag wins)
    with h.up_stack(repository, "--grpc-port", str(grpc), "--workers", str(workers)) as url:
        fleet = _serving(url, workers)
        master = fleet["front_door"]["pid"]

        def haproxy() -> int | None:
            children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
            return int(children[-1]) if children else None

        def pids() -> list[int]:
            return [w["pid"] for w in h.get_json(f"{url}/v2/fleet")["workers"] if w["pid"]]

        yield Place("stack", url, f"127.0.0.1:{grpc}", pids, haproxy)


def _serving(url: str, workers: int, timeout: float = 180.0) -> Any:
    """The fleet once all its workers serve (the front door answers before they do)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet = h.get_json(f"{url}/v2/fleet")
        serving = [w for w in fleet["workers"] if w["ready"] and w["state"] == "serving"]
        if len(serving) >= workers:
            return fleet
        time.sleep(0.2)
    raise RuntimeError(f"the stack at {url} did not get {workers} workers serving")


@dataclass
class Runner:
    """Writes each run's workload and runs `tailserve bench` on it."""

    args: argparse.Namespace
    repository: Path
    out: Path

    def bench(
        self, model: str, place: Place, protocol: str, measure: str, *flags: str, **changes: Any
    ) -> dict[str, Any]:
        wire = PROTOCOLS[protocol]
        name = f"{model}-{place.name}-{protocol}-{measure}"
        spec = h.workload(
            MODELS[model].workload,
            self.out,
            name=name,
            target=place.grpc if wire.startswith("grpc") else place.http,
            protocol=wire,
            model_config=str(self.repository / model / "model.yaml"),
            grpc={"streams": self.args.streams, "channels": self.args.channels},
            processes=self.args.processes,
            **changes,
        )
        return h.bench(spec, self.out / f"{name}.json", *flags, echo=False)

    def measure(self, model: str, place: Place, protocol: str) -> dict[str, Any]:
        args = self.args
        idle = self.bench(
            model,
            place,
            protocol,
            "idle",
            schedule={"kind": "constant", "rate": args.idle_rate},
            duration_s=args.idle_s,
            warmup_s=1.0,
        )["overall"]
        cpu_rate = args.cpu_rate or MODELS[model].cpu_rps
        before_workers, before_hop = self._cpu(place)
        run = self.bench(
            model,
            place,
            protocol,
            "cpu",
            schedule={"kind": "poisson", "rate": cpu_rate},
            duration_s=args.cpu_s,
            warmup_s=0.0,
        )
        after_workers, after_hop = self._cpu(place)
        sent = max(1, run["overall"]["count"])
        capacity = self.bench(
            model,
            place,
            protocol,
            "capacity",
            "--find-capacity",
            schedule={"kind": "poisson", "rate": MODELS[model].start_rps},
            duration_s=args.step_s,
            warmup_s=args.warmup_s,
        )
        at_best = capacity["generator"]
        return {
            "capacity_rps": (capacity["capacity"] or {}).get("rps"),
            "capacity_steps": len(capacity["steps"]),
            "generator_cpu_share": at_best["cpu_share"],
            "generator_behind": at_best["behind"],
            "p50_c1_ms": idle["p50_ms"],
            "p99_c1_ms": idle["p99_ms"],
            # Over 1% of the requests still in flight when the next left: not one at a time.
            "c1_overlapped": (idle["p99_ms"] or 0.0) > 1000.0 / args.idle_rate,
            "c1_errors": idle["errors"],
            "cpu_rate": cpu_rate,
            "worker_cpu_us": (after_workers - before_workers) / sent * 1e6,
            "hop_cpu_us": (after_hop - before_hop) / sent * 1e6 if place.hop() else None,
            "cpu_errors": run["overall"]["errors"],
        }

    @staticmethod
    def _cpu(place: Place) -> tuple[float, float]:
        hop = place.hop()
        workers = sum(h.cpu_seconds(pid) for pid in place.workers())
        return workers, h.cpu_seconds(hop) if hop else 0.0


def wrk2_capacity(model: str, place: Place, args: argparse.Namespace) -> float | None:
    """wrk2's SLO capacity over HTTP/JSON (a cross-check of the bench's), if wrk2 is here."""
    if not os.environ.get("WRK2") and not shutil.which("wrk2"):
        if not Path("/work/tools/wrk2").is_file():
            print("  (wrk2 not found: no cross-check)")
            return None
        os.environ["WRK2"] = "/work/tools/wrk2"
    import _wrk2

    slo = yaml.safe_load((h.WORKLOADS / MODELS[model].workload).read_text())["slo"]["p99_ms"]
    script = getattr(_wrk2, MODELS[model].wrk2_script)
    print(f"  wrk2, {model} over HTTP/JSON, {place.name}:")
    return _wrk2.slo_capacity(
        place.http, args.step_s, slo, start_rps=MODELS[model].start_rps, script=script
    )


def h2load_capacity(
    model: str, place: Place, args: argparse.Namespace, repository: Path
) -> float | None:
    """h2load's SLO capacity over gRPC unary calls (a C generator's cross-check of the
    bench's), if h2load is here."""
    if not shutil.which("h2load"):
        print("  (h2load not found: no gRPC cross-check; apt-get install nghttp2-client)")
        return None
    import _h2load

    workload = h.WORKLOADS / MODELS[model].workload
    slo = yaml.safe_load(workload.read_text())["slo"]["p99_ms"]
    message = _h2load.infer_message(workload, repository / model / "model.yaml")
    print(f"  h2load, {model} over gRPC unary, {place.name}:")
    return _h2load.slo_capacity(
        place.grpc,
        message,
        args.step_s,
        slo,
        start_rps=MODELS[model].start_rps,
        metrics_url=f"{place.http}/metrics",
    )


COLUMNS = (
    ("capacity_rps", "capacity req/s", "{:,.0f}"),
    ("p50_c1_ms", "p50 c=1 ms", "{:.2f}"),
    ("worker_cpu_us", "worker µs/req", "{:,.0f}"),
    ("hop_cpu_us", "front door µs/req", "{:,.0f}"),
    ("generator_cpu_share", "generator CPU", "{:.2f}"),
)


def table(model: str, place: str, rows: dict[str, dict[str, Any]]) -> str:
    base = rows.get("http-json", {})
    head = f"{'protocol':<13}" + "".join(f"{title:>24}" for _, title, _ in COLUMNS)
    lines = [f"{model}, {'direct to one worker' if place == 'worker' else 'through the stack'}"]
    lines += [head, "-" * len(head)]
    for protocol, row in rows.items():
        cells = []
        for key, _, form in COLUMNS:
            value, reference = row.get(key), base.get(key)
            text = "-" if value is None else form.format(value)
            if value is not None and reference and key != "generator_cpu_share":
                text += f" ({value / reference:.2f}x)"
            cells.append(f"{text:>24}")
        flags = " generator behind" if row.get("generator_behind") else ""
        flags += " c=1 overlapped" if row.get("c1_overlapped") else ""
        lines.append(f"{protocol:<13}" + "".join(cells) + flags)
    return "\n".join(lines)


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each number over the rounds (a flag: set if any round set it)."""
    merged: dict[str, Any] = {}
    for key in runs[0]:
        values = [run[key] for run in runs]
        if all(isinstance(v, bool) for v in values):
            merged[key] = any(values)
        elif all(isinstance(v, int | float) for v in values):
            merged[key] = statistics.median(values)
        else:
            numbers = [v for v in values if isinstance(v, int | float)]
            merged[key] = statistics.median(numbers) if numbers else None
    merged["rounds"] = runs
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="churn,sentiment")
    parser.add_argument("--via", default="worker,stack", help="worker, stack or both")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--step-s", type=float, default=10.0, help="a capacity step's seconds")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="a capacity step's warm-up")
    parser.add_argument("--idle-rate", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--cpu-rate", type=float, help="req/s for CPU a request (per model)")
    parser.add_argument("--cpu-s", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="workers of the stack")
    parser.add_argument("--streams", type=int, default=4, help="gRPC streams a process")
    parser.add_argument("--channels", type=int, default=1, help="gRPC connections a process")
    parser.add_argument("--processes", type=int, default=1, help="generator processes")
    parser.add_argument("--wrk2", action="store_true", help="cross-check HTTP/JSON with wrk2")
    parser.add_argument(
        "--h2load", action="store_true", help="cross-check gRPC unary calls with h2load"
    )
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "protocols")
    args = parser.parse_args()
    models = args.models.split(",")
    protocols = [p for p in args.protocols.split(",") if p]
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(protocols) - set(PROTOCOLS))
    if unknown:
        raise SystemExit(f"unknown model or protocol: {unknown[0]}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    wrk2: dict[str, float | None] = {}
    h2load: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = h.models_alone(h.examples(work / "examples"), work / "repo", models)
        runner = Runner(args, repo, args.out)
        for via in args.via.split(","):
            opened = lone_worker(repo) if via == "worker" else stack(repo, args.workers)
            with opened as place:
                for index in range(args.rounds):
                    for model in models:
                        order = protocols if index % 2 == 0 else protocols[::-1]
                        for protocol in order:
                            print(f"round {index + 1}: {model}, {via}, {protocol}", flush=True)
                            result = runner.measure(model, place, protocol)
                            runs.setdefault((model, via, protocol), []).append(result)
                if args.wrk2:
                    for model in models:
                        wrk2[f"{model}-{via}"] = wrk2_capacity(model, place, args)
                if args.h2load:
                    for model in models:
                        h2load[f"{model}-{via}"] = h2load_capacity(model, place, args, repo)
    rows = [
        {"model": model, "via": via, "protocol": protocol, **medians(results)}
        for (model, via, protocol), results in runs.items()
    ]
    print()
    for model in models:
        for via in args.via.split(","):
            found = {r["protocol"]: r for r in rows if r["model"] == model and r["via"] == via}
            print(table(model, via, {p: found[p] for p in protocols if p in found}))
            if wrk2.get(f"{model}-{via}") is not None:
                print(f"wrk2's capacity over HTTP/JSON: {wrk2[f'{model}-{via}']:,.0f} req/s")
            if h2load.get(f"{model}-{via}") is not None:
                print(f"h2load's capacity over gRPC: {h2load[f'{model}-{via}']:,.0f} req/s")
            print()
    document = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "wrk2": wrk2,
        "h2load": h2load,
    }
    path = args.out / "protocols.json"
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
