"""Refuse only what cannot be served in time: a lone worker beside CPU neighbours and under
overload, and the stack against one worker, run after run, measured from outside with wrk2
(open loop, churn with unique inputs, p99 <= 50 ms).

1. worker: a fresh churn worker's SLO capacity C (64 connections; or `--capacity`). Then, each
   on a fresh worker:
   - neighbours: two processes each burning half a core beside it, 0.6x C over 64 connections:
     goodput over offered (wrk2's measured window), refusals from the first request, and the
     worker's own count of false refusals (`tailserve_false_refusals_total`), `--runs` times;
   - overload, `--runs` times: 1.5x, 2x and 3x C over 1,000 connections, one after the other on
     the same worker: goodput (200s within the SLO a second) over C; 5 s after each, half of C
     over 64 connections: the 429s of its first 5 s.
   `--baseline SRC`: the same on a worker run from another source tree (PYTHONPATH=SRC, e.g. a
   `git worktree` of an older commit), alternating with this one at each step.
2. stack: `tailserve up --workers 2` (HAProxy in front), `--stack-runs` times: its SLO capacity
   and one worker's, searched in turns; then 2x and 3x that worker's capacity through the front
   door over 1,000 connections: goodput over one worker's capacity.

    python benchmarks/overload.py [--only neighbours,overload,stack] [--runs 5] [--stack-runs 3]
                                  [--capacity RPS] [--seconds 6] [--baseline SRC]

Needs wrk2 on the PATH or WRK2=... (benchmarks/_wrk2.py). Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import _wrk2
import front_door
from _harness import examples, free_port, one_model, wait_ready, worker
from tailserve.loadgen.capacity import CapacitySearch

SLO_MS = 50.0
FACTORS = (1.5, 2.0, 3.0)


@dataclass
class Tree:
    """A source tree whose worker is measured (`None`: the installed one)."""

    name: str
    src: str | None = None
    rows: list[str] = field(default_factory=list)


@contextlib.contextmanager
def fresh_worker(repository: Path, tree: Tree) -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=tree.src) if tree.src else None
    command = worker(repository, port, "--grpc-port", "0")
    proc = subprocess.Popen(command, start_new_session=True, env=env, **front_door.QUIET)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def false_refusals(url: str) -> str:
    """The worker's count of false refusals ("-": a worker that does not count them)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tailserve_false_refusals_total{")
    ]
    return f"{sum(values):,.0f}" if "tailserve_false_refusals" in text else "-"


def capacity(repository: Path, step_s: float) -> float:
    """A fresh worker's SLO capacity over 64 connections, searched step by step."""
    with fresh_worker(repository, Tree("this")) as url:
        target = front_door.Target("worker", url, lambda: None)
        target.search = CapacitySearch(SLO_MS, start_rps=1500.0, precision=0.1)
        front_door.capacities([target], step_s)
        return target.search.capacity_rps or 0.0


def neighbours_row(repository: Path, tree: Tree, clean: float, seconds: float) -> None:
    """A fresh worker: its refusals are counted from the first request (wrk2 times only what
    follows its 10 s of calibration, when a fresh worker has learnt its costs)."""
    with fresh_worker(repository, tree) as url, front_door.neighbours():
        run = _wrk2.run(url, 0.6 * clean, seconds, 64, count=(0.0, 1e12))
        window = run.answered * run.within(SLO_MS) / run.seconds if run.seconds else 0.0
        tree.rows.append(
            f"| {tree.name} | neighbours, 0.6x | {window / run.rate:.2f} of offered | "
            f"{run.quantile(0.99):.1f} ms | {run.refused:,} from the first request | "
            f"{false_refusals(url)} | {_verdict(window >= 0.9 * run.rate and not run.errors)} |"
        )
        print(tree.rows[-1], flush=True)


def overload_rows(url: str, tree: Tree, clean: float, seconds: float, run_no: int) -> None:
    for factor in FACTORS:
        run = _wrk2.run(url, factor * clean, seconds, 1000)
        good = run.goodput(SLO_MS)
        time.sleep(5.0)  # the overload is over: 5 s later, half the capacity
        after = _wrk2.run(url, clean / 2, seconds, 64, count=(0.0, 5000.0))
        passed = good >= 0.9 * clean and after.refused == 0
        tree.rows.append(
            f"| {tree.name} | run {run_no}, {factor:g}x over 1,000 | {good / clean:.2f}x C | "
            f"{run.quantile(0.99):.1f} ms | {run.refused:,} | {false_refusals(url)} | "
            f"{_verdict(passed)} (after: {after.refused} 429 in 5 s) |"
        )
        print(tree.rows[-1], flush=True)


def worker_section(
    repository: Path, trees: list[Tree], args: argparse.Namespace, only: list[str]
) -> None:
    clean = args.capacity or capacity(repository, args.step_seconds)
    print(f"one worker's SLO capacity C: {clean:,.0f} req/s", flush=True)
    for _ in range(args.runs if "neighbours" in only else 0):
        for tree in trees:
            neighbours_row(repository, tree, clean, args.seconds)
    for run_no in range(1, args.runs + 1 if "overload" in only else 1):
        for tree in trees:
            with fresh_worker(repository, tree) as url:
                overload_rows(url, tree, clean, args.seconds, run_no)
    print(f"\nC = {clean:,.0f} req/s; goal: goodput >= 0.9 (of offered with neighbours, x C alone)")
    print("| tree | load | goodput | p99 | 429 | false refusals | goal |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for tree in trees:
        print("\n".join(tree.rows))


def stack_section(repository: Path, args: argparse.Namespace) -> None:
    rows = []
    for run_no in range(1, args.stack_runs + 1):
        with front_door.lone_worker(repository) as alone, front_door.stack(repository) as door:
            for target in (alone, door):
                target.search = CapacitySearch(SLO_MS, start_rps=1500.0, precision=0.1)
            front_door.capacities([alone, door], args.step_seconds)
            one = alone.search.capacity_rps or 0.0
            both = door.search.capacity_rps or 0.0
            goodput = {}
            for factor in (2.0, 3.0):
                run = _wrk2.run(door.url, factor * one, args.seconds, 1000)
                goodput[factor] = run.goodput(SLO_MS) / one if one else 0.0
        passed = both >= 1.3 * one and goodput[2.0] >= 1.0 and goodput[3.0] >= 0.9
        rows.append(
            f"| {run_no} | {one:,.0f} | {both:,.0f} | {both / one if one else 0:.2f}x | "
            f"{goodput[2.0]:.2f}x | {goodput[3.0]:.2f}x | {_verdict(passed)} |"
        )
        print(rows[-1], flush=True)
    print(
        "\nThe stack (tailserve up --workers 2) against one worker; goal: >= 1.3x, >= 1.0x, >= 0.9x"
    )
    print("| run | one worker | stack | capacity | goodput at 2x | goodput at 3x | goal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    print("\n".join(rows))


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="neighbours,overload,stack", help="worker: both")
    parser.add_argument("--runs", type=int, default=5, help="overload runs of a lone worker")
    parser.add_argument("--stack-runs", type=int, default=3)
    parser.add_argument("--capacity", type=float, default=0.0, help="one worker's, req/s")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds a run")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="a capacity step's")
    parser.add_argument("--baseline", help="another source tree to run alternately (its src/)")
    args = parser.parse_args()
    _wrk2.binary()
    print("python benchmarks/overload.py " + " ".join(sys.argv[1:]), flush=True)
    trees = [Tree("this")] + ([Tree("baseline", args.baseline)] if args.baseline else [])
    with tempfile.TemporaryDirectory() as tmp:
        every = examples(Path(tmp) / "examples")
        repository = one_model(every / "churn", Path(tmp) / "churn-only")
        only = args.only.replace("worker", "neighbours,overload").split(",")
        if "neighbours" in only or "overload" in only:
            worker_section(repository, trees, args, only)
        if "stack" in only:
            stack_section(repository, args)


if __name__ == "__main__":
    main()
