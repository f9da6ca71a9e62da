"""A lean worker, side by side with another source tree (the main it started from): memory,
CPU a request, CPU at rest, and gRPC against HTTP through the stack.

Every section runs each tree in turn (``--baseline SRC``: a `git worktree` of that main, its
workers started with PYTHONPATH=SRC/..., the same interpreter and packages):

1. memory: one worker on the example repository (`tailserve examples`), warmed and ready: its
   resident set, and each model's `tailserve_model_memory_bytes` beside what the model really
   adds (the resident set of a worker of the repository without it, subtracted); then
   `tailserve up --workers 2` on the same repository: the resident sets of its whole process
   tree (supervisor, HAProxy, workers).
2. idle: that worker left alone for ``--idle-s`` (60) seconds once ready: its CPU over them, as
   a share of one core.
3. cpu: churn and sentiment each alone in a worker (result cache off, no variants: every
   request computed by the whole model), sent unique inputs by `tailserve bench` at a fixed
   rate about half of what one worker serves within the SLO (``--rate churn=1000,
   sentiment=400``), over HTTP/JSON, HTTP/binary, gRPC unary and gRPC streams (one
   ModelStreamInfer stream carrying every request; ``--protocols`` picks): the worker's CPU
   (user + system, every thread, /proc) over the requests sent. ``--rounds`` (3) alternating rounds;
   each round's ratio of this tree to the baseline is printed. ``--half``: each tree at half
   its own SLO capacity instead (searched first: wrk2 over HTTP/JSON, the same worker),
   the same rate for each protocol.
4. capacity: one worker of the example churn model as shipped (its cache on, unique inputs),
   its SLO capacity (p99 <= 50 ms, no error) searched by wrk2 over 64 connections, the trees
   in turns.
5. stack: `tailserve up --workers 2` on churn alone (cache off): SLO capacity over HTTP/JSON
   (wrk2, 64 connections) and over gRPC unary calls (h2load: the same message every call,
   which the cache off computes each time; 64 calls in flight over each of
   ``--grpc-connections``, 8 and 64: 8 streams on each of 8, and one a connection as wrk2's),
   ``--stack-rounds`` (1) rounds of searches in turn, their medians;
   then at a tenth of the HTTP capacity, wrk2's p50 and the front door's own CPU a request
   (HAProxy's process).
6. stack-cpu: the same stack at ``--stack-rate`` (2,000) req/s from `tailserve bench` over each
   of ``--protocols`` in turn (gRPC to the front door's gRPC port): CPU a request of the
   workers and supervisor, and of HAProxy, and their sum against HTTP/JSON's in each round.

    python benchmarks/lean.py --baseline /tmp/main/src [--this SRC]
        [--only memory,idle,cpu,capacity,stack,stack-cpu] [--protocols ...] [--stack-rate 2000]
        [--rounds 3] [--idle-s 60] [--cpu-s 15] [--step-s 5] [--rate churn=1000,sentiment=400]
        [--half] [--stack-rounds 1] [--grpc-connections 8,64]

Needs wrk2 (WRK2=... or on the PATH) and h2load (Debian's nghttp2-client). Check with `ps` that
nothing else runs. Prints one table a section.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

import _h2load
import _harness as h
import _wrk2

SLO_MS = {"churn": 50.0, "sentiment": 100.0}
WORKLOADS = {"churn": "churn-unique.yaml", "sentiment": "sentiment-skewed.yaml"}
PROTOCOLS = {
    "http-json": "v2-json",
    "http-binary": "v2-binary",
    "grpc-unary": "grpc",
    "grpc-stream": "grpc-stream",
}
SECTIONS = ("memory", "idle", "cpu", "capacity", "stack", "stack-cpu")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Tree:
    name: str
    src: str | None  # None: this checkout's installed package

    def env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONPATH=self.src) if self.src else dict(os.environ)


# --- processes ------------------------------------------------------------------------------


@contextlib.contextmanager
def started(command: list[str], url: str, tree: Tree) -> Iterator[subprocess.Popen[bytes]]:
    """A server process of ``tree`` (in a session of its own) until the block ends."""
    process = subprocess.Popen(command, env=tree.env(), start_new_session=True, **h.QUIET)
    try:
        h.wait_ready(url, process)
        yield process
    finally:
        h.stop_group(process)


@contextlib.contextmanager
def worker(repository: Path, tree: Tree, grpc: bool = True) -> Iterator[tuple[str, int, str]]:
    """One worker: its URL, pid and gRPC address."""
    port, grpc_port = h.free_port(), h.free_port() if grpc else 0
    command = h.worker(repository, port, "--grpc-port", str(grpc_port))
    url = f"http://127.0.0.1:{port}"
    with started(command, url, tree) as process:
        yield url, process.pid, f"127.0.0.1:{grpc_port}"


@contextlib.contextmanager
def stack(repository: Path, tree: Tree) -> Iterator[tuple[str, int, str]]:
    """`tailserve up --workers 2` with gRPC: its URL, the supervisor's pid, gRPC's address."""
    port, grpc_port = h.free_port(), h.free_port()
    command = h.up_command(repository, port, "--workers", "2", "--grpc-port", str(grpc_port))
    url = f"http://127.0.0.1:{port}"
    with started(command, url, tree) as process:
        serving(url, 2)
        yield url, process.pid, f"127.0.0.1:{grpc_port}"


def serving(url: str, workers: int, timeout: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet: dict[str, Any] = h.get_json(f"{url}/v2/fleet")
        if sum(1 for w in fleet["workers"] if w["ready"] and w["state"] == "serving") >= workers:
            return fleet
        time.sleep(0.2)
    raise RuntimeError(f"{url}: {workers} workers did not come to serve")


def resident(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError):
        return 0


def metric(url: str, name: str) -> dict[str, float]:
    """A gauge's samples by their model label."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            model = labels.split('model="', 1)[1].split('"', 1)[0]
            out[model] = float(value)
    return out


def mib(value: float) -> str:
    return f"{value / 2**20:,.0f} MiB"


def ratio(this: float, base: float) -> str:
    return f"{this / base:.2f}x" if base else "-"


# --- sections -------------------------------------------------------------------------------


def memory(trees: list[Tree], examples: Path, work: Path) -> None:
    print("\n## memory: one worker on the example repository, ready")
    without: dict[str, Path] = {}
    for model in ("sentiment", "churn"):
        target = work / f"without-{model}"
        if not target.exists():
            shutil.copytree(examples, target)
            shutil.rmtree(target / model)
        without[model] = target
    rows = []
    for tree in trees:
        with worker(examples, tree) as (url, pid, _):
            time.sleep(2.0)
            whole = resident(pid)
            claimed = metric(url, "tailserve_model_memory_bytes")
        real = {}
        for model, repository in without.items():
            with worker(repository, tree) as (_, pid, _):
                time.sleep(2.0)
                real[model] = whole - resident(pid)
        with stack(examples, tree) as (url, root, _):
            time.sleep(2.0)
            total = sum(resident(pid) for pid in h.process_tree(root))
        rows.append((tree, whole, claimed, real, total))
        print(f"  {tree.name}: worker {mib(whole)}, up --workers 2 {mib(total)}")
    print("\n| | " + " | ".join(t.name for t, *_ in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    print("| one worker, resident | " + " | ".join(mib(r[1]) for r in rows) + " |")
    print("| `up --workers 2`, whole tree | " + " | ".join(mib(r[4]) for r in rows) + " |")
    for model in without:
        cells = [f"{mib(r[2].get(model, 0))} / {mib(r[3][model])}" for r in rows]
        print(f"| {model}: metric / measured | " + " | ".join(cells) + " |")


def idle(trees: list[Tree], examples: Path, seconds: float) -> None:
    print(f"\n## idle: one worker on the example repository, {seconds:.0f} s untouched")
    cells = []
    for tree in trees:
        with worker(examples, tree) as (_, pid, _):
            time.sleep(5.0)  # past the start's own work
            before = h.cpu_seconds(pid)
            time.sleep(seconds)
            share = (h.cpu_seconds(pid) - before) / seconds
        cells.append(f"{share * 100:.2f}% of a core")
        print(f"  {tree.name}: {cells[-1]}")
    print("\n| | " + " | ".join(t.name for t in trees) + " |")
    print("| --- |" + " ---: |" * len(trees))
    print("| idle worker's CPU | " + " | ".join(cells) + " |")


def send(
    model: str,
    protocol: str,
    url: str,
    grpc: str,
    rate: float,
    seconds: float,
    out: Path,
    generator: Tree,
) -> float:
    """A `tailserve bench` run at ``rate``: the requests it sent (the warm-up's too)."""
    wire = PROTOCOLS[protocol]
    repository = out / "computed"
    spec = h.workload(
        WORKLOADS[model],
        out,
        name=f"{model}-{protocol}",
        target=grpc if wire.startswith("grpc") else url,
        protocol=wire,
        model_config=str(repository / model / "model.yaml"),
        schedule={"kind": "poisson", "rate": rate},
        duration_s=seconds,
        warmup_s=2.0,
    )
    result_path = out / f"{model}-{protocol}.json"
    command = [sys.executable, "-m", "tailserve.cli", "bench", str(spec), "--quiet"]
    # (The generator from the first tree's source, whatever the checkout holds meanwhile.)
    subprocess.run(
        [*command, "--out", str(result_path)], env=generator.env(), check=True, **h.QUIET
    )
    result = orjson.loads(result_path.read_bytes())
    answered = result["overall"]["count"] / seconds
    print(f"    ({protocol} at {rate:,.0f} req/s: {answered:,.0f} answered a second)")
    return float(result["overall"]["count"] + rate * 2.0)


def bench_cpu(
    model: str,
    protocol: str,
    url: str,
    grpc: str,
    pid: int,
    rate: float,
    seconds: float,
    out: Path,
    generator: Tree,
) -> float:
    """The worker's CPU a request (µs) over a `tailserve bench` run at ``rate``."""
    before = h.cpu_seconds(pid)
    sent = send(model, protocol, url, grpc, rate, seconds, out, generator)
    return (h.cpu_seconds(pid) - before) / max(1.0, sent) * 1e6


def half_capacities(trees: list[Tree], work: Path, step_s: float) -> dict[tuple[str, str], float]:
    """Half of each tree's SLO capacity for each model alone (wrk2, HTTP/JSON), by (tree,
    model)."""
    rates = {}
    for model in ("churn", "sentiment"):
        workload = {"script": _wrk2.SENTIMENT} if model == "sentiment" else {}
        for tree in trees:
            print(f"  {tree.name}, {model}: SLO capacity")
            with worker(work / f"only-{model}", tree, grpc=False) as (url, _, _):
                found = _wrk2.slo_capacity(url, step_s, SLO_MS[model], 1000, **workload)
            rates[(tree.name, model)] = max(50.0, found / 2)
            print(f"  {tree.name}, {model}: {found:,.0f} req/s, so {found / 2:,.0f}")
    return rates


def cpu(trees: list[Tree], examples: Path, work: Path, args: argparse.Namespace) -> None:
    how = "at half its own SLO capacity" if args.half else "at about half its capacity"
    print(f"\n## cpu: the worker's CPU a request {how}, µs")
    repository = h.models_alone(examples, work / "computed", ["churn", "sentiment"])
    for model in ("churn", "sentiment"):
        single = work / f"only-{model}"
        if not single.exists():
            single.mkdir()
            shutil.copytree(repository / model, single / model)
    rates = {(t.name, m): args.rates[m] for t in trees for m in ("churn", "sentiment")}
    if args.half:
        rates = half_capacities(trees, work, args.step_s)
    figures: dict[tuple[str, str, str], list[float]] = {}
    for round_no in range(args.rounds):
        order = trees if round_no % 2 == 0 else trees[::-1]
        for model in ("churn", "sentiment"):
            single = work / f"only-{model}"
            for protocol in args.protocols:
                for tree in order:
                    with worker(single, tree) as (url, pid, grpc):
                        used = bench_cpu(
                            model,
                            protocol,
                            url,
                            grpc,
                            pid,
                            rates[(tree.name, model)],
                            args.cpu_s,
                            work,
                            trees[0],
                        )
                    figures.setdefault((model, protocol, tree.name), []).append(used)
                line = " ".join(
                    f"{t.name} {figures[(model, protocol, t.name)][-1]:,.0f}" for t in trees
                )
                print(f"  round {round_no + 1}, {model} {protocol}: {line}")
    names = [t.name for t in trees]
    if args.half:
        print("\n| rate (half the SLO capacity) | " + " | ".join(names) + " |")
        print("| --- |" + " ---: |" * len(names))
        for model in ("churn", "sentiment"):
            cells = [f"{rates[(n, model)]:,.0f} req/s" for n in names]
            print(f"| {model} | " + " | ".join(cells) + " |")
    print("\n| model, protocol | " + " | ".join(names) + " | ratio each round |")
    print("| --- |" + " ---: |" * len(names) + " --- |")
    for model in ("churn", "sentiment"):
        for protocol in args.protocols:
            runs = [figures[(model, protocol, n)] for n in names]
            cells = [f"{statistics.median(r):,.0f}" for r in runs]
            ratios = ""
            if len(runs) == 2:
                ratios = ", ".join(ratio(a, b) for a, b in zip(runs[0], runs[1], strict=True))
            print(f"| {model}, {protocol} | " + " | ".join(cells) + f" | {ratios} |")


def capacity(trees: list[Tree], examples: Path, work: Path, step_s: float) -> None:
    print("\n## capacity: one worker of churn as shipped, wrk2, p99 <= 50 ms, 64 connections")
    single = work / "churn-shipped"
    if not single.exists():
        single.mkdir()
        shutil.copytree(examples / "churn", single / "churn")
    found = {}
    for tree in trees:
        print(f"  {tree.name}:")
        with worker(single, tree, grpc=False) as (url, _, _):
            found[tree.name] = _wrk2.slo_capacity(url, step_s, SLO_MS["churn"], start_rps=2000)
    print("\n| | " + " | ".join(found) + " |")
    print("| --- |" + " ---: |" * len(found))
    values = list(found.values())
    cells = [f"{v:,.0f} req/s" for v in values]
    print("| SLO capacity | " + " | ".join(cells) + f" | {ratio(values[0], values[-1])} |")


def stack_section(
    trees: list[Tree],
    examples: Path,
    work: Path,
    step_s: float,
    rounds: int = 1,
    shapes: tuple[int, ...] = (8, 64),
) -> None:
    """``shapes``: h2load's connection counts, 64 calls in flight over each."""
    print("\n## stack: `up --workers 2`, churn with its cache off: HTTP/JSON and gRPC unary")
    repository = work / "stack-churn"
    if not repository.exists():
        repository.mkdir()
        shutil.copytree(work / "computed" / "churn", repository / "churn")
    workload = h.WORKLOADS / WORKLOADS["churn"]
    message = _h2load.infer_message(workload, repository / "churn" / "model.yaml")
    rows = {}
    for tree in trees:
        print(f"  {tree.name}:")
        with stack(repository, tree) as (url, root, grpc):
            searched: list[list[float]] = []
            for _ in range(rounds):  # (each search one sample of a noisy machine: in turns)
                found = [_wrk2.slo_capacity(url, step_s, SLO_MS["churn"], start_rps=2000)]
                for connections in shapes:
                    print(f"  gRPC over {connections} connections:")
                    found.append(
                        _h2load.slo_capacity(
                            grpc,
                            message,
                            step_s,
                            SLO_MS["churn"],
                            start_rps=2000,
                            metrics_url=f"{url}/metrics",
                            connections=connections,
                        )
                    )
                searched.append(found)
                print(
                    f"  HTTP/JSON {found[0]:,.0f}, gRPC "
                    + ", ".join(
                        f"{calls:,.0f} over {n} ({ratio(calls, found[0])})"
                        for n, calls in zip(shapes, found[1:], strict=True)
                    )
                )
            medians = [statistics.median(f[i] for f in searched) for i in range(len(shapes) + 1)]
            hop = haproxy_pid(root)
            rate = max(50.0, medians[0] / 10)
            before = h.cpu_seconds(hop) if hop else 0.0
            light = _wrk2.run(url, rate, 15, connections=16)
            hop_us = (h.cpu_seconds(hop) - before) / max(1, light.total) * 1e6 if hop else 0.0
        rows[tree.name] = (medians, light.quantile(0.5), hop_us, rate)
    names = list(rows)
    print("\n| | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    print(
        "| HTTP/JSON capacity (wrk2, 64 connections) | "
        + " | ".join(f"{r[0][0]:,.0f}" for r in rows.values())
    )
    for i, connections in enumerate(shapes, start=1):
        streams = max(1, 64 // connections)
        print(
            f"| gRPC unary capacity (h2load, {connections} connections x {streams}) | "
            + " | ".join(f"{r[0][i]:,.0f}" for r in rows.values())
        )
        print(
            f"| gRPC / HTTP ({connections} x {streams}) | "
            + " | ".join(f"{r[0][i] / r[0][0]:.2f}x" if r[0][0] else "-" for r in rows.values())
        )
    print(
        "| p50 at a tenth of HTTP's capacity | "
        + " | ".join(f"{r[1]:.2f} ms ({r[3]:,.0f} req/s)" for r in rows.values())
    )
    print("| front door CPU a request | " + " | ".join(f"{r[2]:,.0f} µs" for r in rows.values()))


def stack_cpu(trees: list[Tree], work: Path, args: argparse.Namespace) -> None:
    """CPU a request through `tailserve up --workers 2` for each protocol at one rate: the
    workers' and supervisor's, and the front door's (HAProxy's processes)."""
    rate = args.stack_rate
    print(f"\n## stack-cpu: `up --workers 2`, churn with its cache off, {rate:,.0f} req/s, µs")
    repository = work / "stack-churn"
    if not repository.exists():
        repository.mkdir()
        shutil.copytree(work / "computed" / "churn", repository / "churn")
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_no in range(args.rounds):
        order = trees if round_no % 2 == 0 else trees[::-1]
        for tree in order:
            with stack(repository, tree) as (url, root, grpc):
                for protocol in args.protocols:
                    before = tree_cpu(root)
                    sent = send("churn", protocol, url, grpc, rate, args.cpu_s, work, trees[0])
                    after = tree_cpu(root)
                    per = 1e6 / max(1.0, sent)
                    used = ((after[0] - before[0]) * per, (after[1] - before[1]) * per)
                    figures.setdefault((protocol, tree.name), []).append(used)
                    print(
                        f"  round {round_no + 1}, {tree.name} {protocol}: stack "
                        f"{used[0]:,.0f}, front door {used[1]:,.0f}"
                    )
    names = [t.name for t in trees]
    heads = " | ".join(f"{n}: workers + front door" for n in names)
    print(f"\n| protocol | {heads} | of HTTP/JSON's, each round |")
    print("| --- |" + " ---: |" * len(names) + " --- |")
    for protocol in args.protocols:
        cells = []
        for name in names:
            runs = figures[(protocol, name)]
            stack_us = statistics.median(r[0] for r in runs)
            door_us = statistics.median(r[1] for r in runs)
            cells.append(f"{stack_us:,.0f} + {door_us:,.0f}")
        mine, http = figures[(protocol, names[0])], figures.get(("http-json", names[0]))
        ratios = ""
        if http is not None:
            ratios = ", ".join(ratio(sum(a), sum(b)) for a, b in zip(mine, http, strict=True))
        print(f"| {protocol} | " + " | ".join(cells) + f" | {ratios} |")


def tree_cpu(root: int) -> tuple[float, float]:
    """CPU seconds used so far under ``root``: the rest of the tree's, and HAProxy's."""
    rest = door = 0.0
    for pid in h.process_tree(root):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            used = h.cpu_seconds(pid)
        except OSError:
            continue
        if comm == "haproxy":
            door += used
        else:
            rest += used
    return rest, door


def haproxy_pid(root: int) -> int | None:
    for pid in h.process_tree(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "haproxy":
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                return int(children[-1]) if children else pid
        except OSError:
            continue
    return None


# --- main -----------------------------------------------------------------------------------


def rates(text: str) -> dict[str, float]:
    out = {"churn": 1000.0, "sentiment": 400.0}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        out[name] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another tree's src folder (PYTHONPATH)")
    parser.add_argument("--this", help="this tree's src folder, if not the installed one")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--cpu-s", type=float, default=15.0)
    parser.add_argument("--step-s", type=float, default=5.0)
    parser.add_argument("--rate", type=rates, default=rates(""), dest="rates")
    parser.add_argument(
        "--protocols",
        type=lambda text: [p for p in text.split(",") if p],
        default=list(PROTOCOLS),
        help="cpu: of " + ", ".join(PROTOCOLS),
    )
    parser.add_argument("--half", action="store_true", help="cpu: each tree at half its capacity")
    parser.add_argument(
        "--stack-rate", type=float, default=2000.0, help="stack-cpu: requests a second"
    )
    parser.add_argument("--stack-rounds", type=int, default=1, help="stack: searches in turn")
    parser.add_argument("--work", type=Path, help="a folder kept between runs (examples)")
    parser.add_argument(
        "--grpc-connections",
        default="8,64",
        help="stack: h2load's connection counts, 64 calls in flight over each",
    )
    args = parser.parse_args()
    if not os.environ.get("WRK2") and Path("/work/tools/wrk2").is_file():
        os.environ["WRK2"] = "/work/tools/wrk2"
    trees = [Tree("this", str(Path(args.this).resolve()) if args.this else None)]
    if args.baseline:
        trees.append(Tree("baseline", str(Path(args.baseline).resolve())))
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        examples = work / "examples"
        if not (examples / "churn" / "model.yaml").exists():
            h.examples(examples)
        h.models_alone(examples, work / "computed", ["churn", "sentiment"])
        sections: dict[str, Callable[[], None]] = {
            "memory": lambda: memory(trees, examples, work),
            "idle": lambda: idle(trees, examples, args.idle_s),
            "cpu": lambda: cpu(trees, examples, work, args),
            "capacity": lambda: capacity(trees, examples, work, args.step_s),
            "stack": lambda: stack_section(
                trees,
                examples,
                work,
                args.step_s,
                args.stack_rounds,
                tuple(int(n) for n in args.grpc_connections.split(",")),
            ),
            "stack-cpu": lambda: stack_cpu(trees, work, args),
        }
        for name in SECTIONS:
            if name in only:
                sections[name]()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
