"""The worker's CPU a request against the floor a Python server stands on, side by side.

Churn alone in a worker (its result cache off: every request computed), sent unique rows by wrk2
at a fixed rate over 64 connections; the server's CPU (user + system, every thread, /proc) over
the requests wrk2 sent, in µs. Beside it, `_floor_server.py`: the least an asyncio server does
to answer the same requests in batches with the same libraries (uvloop, httptools, orjson,
numpy, ONNX Runtime), once with a task and a future a request and once with neither. With
``--baseline SRC``, the worker of another source tree too (a `git worktree` of an earlier main,
its `src`). The configurations take turns, ``--rounds`` times.

    WRK2=/path/to/wrk python benchmarks/cpu_floor.py [--rate 1000] [--seconds 10]
        [--rounds 3] [--baseline /tmp/main/src]

Check with `ps` that nothing else runs. Prints each round's figures, then the medians and their
ratios to this worker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import _harness as h
import _wrk2

HERE = Path(__file__).resolve().parent


def measure(command: list[str], env: dict[str, str], rate: float, seconds: float) -> float:
    """The server's CPU a request (µs) over one wrk2 run at ``rate``."""
    port = h.free_port()
    command = [part.replace("{port}", str(port)) for part in command]
    with h.server_process(command, port, env=env, start_new_session=True) as (url, process):
        before = h.cpu_seconds(process.pid)
        run = _wrk2.run(f"{url}/v2/models/churn/infer", rate, seconds, connections=64, threads=1)
        used = h.cpu_seconds(process.pid) - before
    failed = run.refused + run.unavailable + run.other + run.socket_errors
    if failed or not run.ok:
        raise RuntimeError(f"{command[:4]}: {failed} requests failed, {run.ok} answered")
    return used / max(1, run.total) * 1e6  # (the CPU and the count both span the whole run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="another tree's src/ (its worker runs too)")
    parser.add_argument("--examples", type=Path, help="an examples folder (else made now)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples = args.examples or h.examples(work / "examples")
        repository = h.models_alone(examples, work / "computed", ["churn"])
        onnx = str(repository / "churn" / "1" / "model.onnx")
        worker = h.worker(repository, 0, "--grpc-port", "0")
        worker[worker.index("--http-port") + 1] = "{port}"
        floor = [sys.executable, str(HERE / "_floor_server.py"), onnx, "{port}"]
        env = dict(os.environ)
        configs: dict[str, tuple[list[str], dict[str, str]]] = {
            "this worker": (worker, env),
            "floor: a task and a future a request": ([*floor, "tasks"], env),
            "floor: callbacks only": ([*floor, "callbacks"], env),
        }
        if args.baseline:
            configs["baseline worker"] = (worker, dict(env, PYTHONPATH=args.baseline))
        figures: dict[str, list[float]] = {name: [] for name in configs}
        for round_ in range(1, args.rounds + 1):
            for name, (command, environment) in configs.items():
                figure = measure(command, environment, args.rate, args.seconds)
                figures[name].append(figure)
                print(f"round {round_}: {name}: {figure:.0f} µs a request", flush=True)
        report(figures, args)


def report(figures: dict[str, list[float]], args: argparse.Namespace) -> None:
    median: Callable[[list[float]], float] = statistics.median
    worker = figures["this worker"]
    print(f"\n## CPU a request, churn over HTTP/JSON at {args.rate:.0f} req/s (µs, median)")
    print("| server | µs a request | each round | ratio to this worker, each round |")
    print("| --- | ---: | --- | --- |")
    for name, values in figures.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        ratios = ", ".join(f"{v / w:.2f}x" for v, w in zip(values, worker, strict=True))
        print(f"| {name} | {median(values):.0f} | {rounds} | {ratios} |")


if __name__ == "__main__":
    main()
