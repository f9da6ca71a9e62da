"""tailserve bench: run a workload file, or compare saved results.

tailserve bench WORKLOAD.yaml [--target URL] [--protocol P] [--rate R] [--duration S]
                [--out result.json] [--report report.html] [--find-capacity] [--rates R1,R2,...]
tailserve bench compare A.json B.json ... [--report compare.html]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec
import orjson

from tailserve.errors import ConfigError


def add_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="open-loop load generator and reports (or: bench compare A.json B.json ...)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("paths", nargs="+", metavar="WORKLOAD", help="workload YAML")
    bench.add_argument(
        "--target", help="server URL, or host:port over gRPC (overrides the workload's)"
    )
    bench.add_argument(
        "--protocol",
        choices=("v2-json", "v2-binary", "v1-records", "grpc", "grpc-stream"),
        help="what the requests travel as (overrides the workload's)",
    )
    bench.add_argument("--streams", type=int, help="grpc-stream: streams per generator process")
    bench.add_argument(
        "--model-config", help="the model's model.yaml or config URL (needed over gRPC)"
    )
    bench.add_argument("--rate", type=float, help="offered rate, req/s (overrides the schedule's)")
    bench.add_argument("--duration", type=float, help="measured seconds")
    bench.add_argument("--warmup", type=float, help="warm-up seconds, sent but not measured")
    bench.add_argument("--processes", type=int, help="generator processes")
    bench.add_argument("--connections", type=int, help="connections per generator process")
    bench.add_argument(
        "--timer",
        choices=("fine", "loop"),
        help="what times the sends: fine (default) or the event loop's 1 ms",
    )
    bench.add_argument("--name", help="the run's name in reports and comparisons")
    bench.add_argument("--out", type=Path, help="write the JSON result here")
    bench.add_argument("--report", type=Path, help="write an HTML report with plots here")
    bench.add_argument("--find-capacity", action="store_true", help="search for SLO capacity")
    bench.add_argument("--rates", help="comma-separated offered rates: one step each")
    bench.add_argument("--quiet", action="store_true", help="no live progress line")
    bench.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    if args.paths[0] == "compare":
        return _compare([Path(p) for p in args.paths[1:]], args.report)
    if len(args.paths) != 1:
        raise ConfigError("bench takes one workload file (or: bench compare A.json B.json ...)")
    from tailserve.loadgen import report
    from tailserve.loadgen.bench import run_bench
    from tailserve.loadgen.workload import Schedule, load_workload, parse_workload

    workload = load_workload(Path(args.paths[0]))
    schedule = workload.schedule
    if args.rate is not None:
        if schedule.kind not in ("constant", "poisson"):
            schedule = Schedule(kind="poisson", rate=args.rate)
        else:
            schedule = Schedule(kind=schedule.kind, rate=args.rate)
    grpc = workload.grpc
    if args.streams is not None:
        grpc = msgspec.structs.replace(grpc, streams=args.streams)
    workload = workload.with_overrides(
        target=args.target,
        protocol=args.protocol,
        model_config=args.model_config,
        grpc=grpc,
        duration_s=args.duration,
        warmup_s=args.warmup,
        processes=args.processes,
        connections=args.connections,
        schedule=schedule,
        timer=args.timer,
    )
    # (checked again: a flag may make a workload that no file could, gRPC with a trace)
    workload = parse_workload(msgspec.to_builtins(workload), source=args.paths[0])
    rates = _rates(args.rates)
    progress = None if args.quiet else sys.stderr
    document = run_bench(
        workload, name=args.name, rates=rates, find_capacity=args.find_capacity, progress=progress
    )
    if document["steps"]:
        print(report.steps_table(document["steps"]))
        print()
    print(report.table(document))
    server = document.get("server") or {}
    if server:
        print("server: " + ", ".join(f"{k} {_short(v)}" for k, v in server.items()))
    if args.out is not None:
        write_result(document, args.out)
        print(f"result: {args.out}")
    if args.report is not None:
        report.write_html([document], args.report)
        print(f"report: {args.report}")
    return 0


def _compare(paths: list[Path], html: Path | None) -> int:
    from tailserve.loadgen import report

    if len(paths) < 2:
        raise ConfigError("bench compare needs two or more result files")
    results = [read_result(path) for path in paths]
    print(report.compare_table(results))
    if html is not None:
        report.write_html(results, html)
        print(f"report: {html}")
    return 0


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _rates(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--rates: not a list of numbers: {text!r}") from None
    if not rates or any(rate <= 0 for rate in rates):
        raise ConfigError("--rates: give positive rates, e.g. 100,200,400")
    return rates


def write_result(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    options = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
    path.write_bytes(orjson.dumps(document, option=options))


def read_result(path: Path) -> dict[str, Any]:
    try:
        document = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the result {path}: {exc}") from None
    if not isinstance(document, dict) or "overall" not in document:
        raise ConfigError(f"{path}: not a bench result (no 'overall')")
    return document
