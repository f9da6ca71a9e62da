"""gRPC against HTTP/JSON through the stack, CPU a request, loaded by C generators.

`tailserve up --workers 2` on churn alone (cache off), as `lean.py`'s stack sections start it;
at each of ``--rates`` in turn: wrk2 over HTTP/JSON (64 connections, unique rows), then h2load
over gRPC unary calls to the front door's gRPC port (8 connections of 8 streams, and 64
connections of one). For each run: the CPU a request of the workers and supervisor, of HAProxy,
and of the generator itself (its user + system time, so that a starved generator shows), and
the stack's sum against HTTP/JSON's at the same rate. ``--rounds`` rounds, each on a fresh
stack. `lean.py --only stack-cpu` measures the same with `tailserve bench` (which also speaks
the binary extension and streams); this one is what a C client meets, at rates near capacity
too.

    python benchmarks/door_cpu.py [--rates 2000,8000] [--rounds 2] [--seconds 10]

Needs wrk2 (WRK2=... or on the PATH) and h2load (Debian's nghttp2-client). Check with `ps` that
nothing else runs.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _h2load
import _harness as h
import _wrk2
import lean

RUNS = ("HTTP/JSON (wrk2, 64)", "gRPC unary (h2load, 8 x 8)", "gRPC unary (h2load, 64 x 1)")


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def measure(root: int, rate: float, go: Callable[[], object]) -> tuple[float, float, float]:
    """The stack's, the front door's and the generator's CPU a request (µs) over ``go``."""
    generator, tree, started = children_cpu(), lean.tree_cpu(root), time.monotonic()
    go()
    sent = rate * (time.monotonic() - started)
    after = lean.tree_cpu(root)
    per = 1e6 / max(1.0, sent)
    return (
        (after[0] - tree[0]) * per,
        (after[1] - tree[1]) * per,
        (children_cpu() - generator) * per,
    )


def loads(
    url: str, grpc: str, message: bytes, rate: float, seconds: float
) -> dict[str, Callable[[], object]]:
    """Each of `RUNS` at ``rate`` for ``seconds``, to be called in turn."""
    return {
        RUNS[0]: lambda: _wrk2.run(url, rate, seconds, 64),
        RUNS[1]: lambda: _h2load.run(grpc, message, rate, seconds, streams=8),
        RUNS[2]: lambda: _h2load.run(grpc, message, rate, seconds, connections=64, streams=1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="2000,8000", help="requests a second, in turn")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--work", type=Path, help="a folder kept between runs (examples)")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    work = args.work or Path(tempfile.mkdtemp(prefix="door-cpu-"))
    examples = work / "examples"
    if not (examples / "churn" / "model.yaml").exists():
        h.examples(examples)
    h.models_alone(examples, work / "computed", ["churn"])
    repository = work / "stack-churn"
    if not repository.exists():
        repository.mkdir()
        shutil.copytree(work / "computed" / "churn", repository / "churn")
    spec = h.workload(lean.WORKLOADS["churn"], work, name="door-cpu")
    message = _h2load.infer_message(spec, work / "computed" / "churn" / "model.yaml")
    figures: dict[tuple[float, str], list[tuple[float, float, float]]] = {}
    for round_no in range(args.rounds):
        with lean.stack(repository, lean.Tree("this", None)) as (url, root, grpc):
            for rate in rates:
                for name, go in loads(url, grpc, message, rate, args.seconds).items():
                    used = measure(root, rate, go)
                    figures.setdefault((rate, name), []).append(used)
                    print(
                        f"  round {round_no + 1}, {rate:,.0f} req/s, {name}: stack "
                        f"{used[0]:,.0f}, front door {used[1]:,.0f}, generator {used[2]:,.0f}"
                    )
    print("\n| rate | load | workers + front door, µs | generator | of HTTP/JSON's, each round |")
    print("| ---: | --- | ---: | ---: | --- |")
    for rate in rates:
        http = figures[(rate, RUNS[0])]
        for name in RUNS:
            rows = figures[(rate, name)]
            stack = statistics.median(r[0] for r in rows)
            door = statistics.median(r[1] for r in rows)
            generator = statistics.median(r[2] for r in rows)
            ratios = ", ".join(
                lean.ratio(a[0] + a[1], b[0] + b[1]) for a, b in zip(rows, http, strict=True)
            )
            print(
                f"| {rate:,.0f} | {name} | {stack:,.0f} + {door:,.0f} | {generator:,.0f} | "
                f"{ratios} |"
            )


if __name__ == "__main__":
    main()
