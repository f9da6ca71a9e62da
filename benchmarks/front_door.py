"""Hold the line: one worker, the stack through its front door (HAProxy) and through the Python
router, side by side, measured from outside with wrk2 (open loop, churn with unique inputs).

1. SLO capacity (64 connections) of each, the searches taking turns one step at a time (the
   machine's speed drifts); then, at a light load, each hop's added p50 and its CPU a request.
2. Overload over 1,000 connections: 2x and 3x one worker's capacity for the measured seconds;
   goodput (200s within the SLO a second); 5 s later, half of one worker's capacity: refusals
   and p99 (wrk2, and `tailserve bench` beside it for the stack).
3. A fresh worker while two neighbour processes each burn half a core: 0.6x its clean capacity
   (goodput over offered); the neighbours stop, and the first 5 s at that load count refusals.

    python benchmarks/front_door.py [--seconds 10] [--step-seconds 5] [--skip-contention]

Needs wrk2 on the PATH (see benchmarks/_wrk2.py). Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import _wrk2
from _harness import cpu_seconds, examples, free_port, get_json, one_model, wait_ready, worker
from tailserve.loadgen.capacity import CapacitySearch, Step

SLO_MS = 50.0
QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


@dataclass
class Target:
    name: str
    url: str
    cpu_pid: Callable[[], int | None]  # the hop's process (None: no hop)
    direct: str | None = None  # one of its own workers, called without the hop
    search: CapacitySearch = field(
        default_factory=lambda: CapacitySearch(SLO_MS, start_rps=1500.0, precision=0.1)
    )
    runs: dict[str, _wrk2.Run] = field(default_factory=dict)


@contextlib.contextmanager
def process(command: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(command, start_new_session=True, **QUIET)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def lone_worker(repository: Path) -> Iterator[Target]:
    port = free_port()
    with process(worker(repository, port, "--grpc-port", "0"), port):
        yield Target("worker", f"http://127.0.0.1:{port}", lambda: None)


@contextlib.contextmanager
def stack(repository: Path) -> Iterator[Target]:
    """`tailserve up --workers 2`, as `make run` starts it on these 2 cores."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "up",
        "--repository",
        str(repository),
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--workers",
        "2",
        "--log-level",
        "warning",
    ]
    with process(command, port):
        url = f"http://127.0.0.1:{port}"
        master = get_json(f"{url}/v2/fleet")["front_door"]["pid"]

        def haproxy_worker() -> int | None:
            children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
            return int(children[-1]) if children else None

        worker_url = get_json(f"{url}/v2/fleet")["workers"][0]["url"]
        yield Target("stack", url, haproxy_worker, direct=worker_url)


@contextlib.contextmanager
def routed(repository: Path) -> Iterator[Target]:
    """Two workers behind the Python router (`tailserve route`)."""
    ports = [free_port(), free_port()]
    with contextlib.ExitStack() as stack_:
        for port in ports:
            stack_.enter_context(process(worker(repository, port, "--grpc-port", "0"), port))
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "route",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--log-level",
            "warning",
            *(f"--backend=http://127.0.0.1:{p}" for p in ports),
        ]
        router = stack_.enter_context(process(command, port))
        yield Target(
            "router",
            f"http://127.0.0.1:{port}",
            lambda: router.pid,
            direct=f"http://127.0.0.1:{ports[0]}",
        )


@contextlib.contextmanager
def neighbours(count: int = 2) -> Iterator[None]:
    """Processes that each burn half a core (5 ms busy, 5 ms asleep)."""
    code = (
        "import time\nwhile True:\n    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < 0.005: pass\n    time.sleep(0.005)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def step(target: Target, rate: float, seconds: float) -> Step:
    run = _wrk2.run(target.url, rate, seconds, connections=64)
    achieved = run.answered / run.seconds if run.seconds else 0.0
    p99 = run.quantile(0.99)
    print(
        f"  {target.name:7} {rate:8.0f} req/s: p99 {p99:8.2f} ms, errors {run.errors}, "
        f"achieved {achieved:8.0f}",
        flush=True,
    )
    return Step(rate, achieved, p99, run.errors)


def capacities(targets: list[Target], seconds: float) -> None:
    """The searches take turns, a step each."""
    active = list(targets)
    while active:
        for target in list(active):
            rate = target.search.next_rate()
            if rate is None:
                active.remove(target)
                continue
            target.search.record(step(target, rate, seconds))


def hop_costs(targets: list[Target], rate: float, seconds: float) -> dict[str, tuple[float, float]]:
    """Each hop's added p50 at a light load (against one of its own workers called directly,
    the two alternating, twice: the median of each), and its CPU a request (µs)."""
    out = {}
    for target in targets:
        if target.direct is None:
            continue
        pid = target.cpu_pid()
        direct, hop, cpu = [], [], []
        for _ in range(2):
            direct.append(_wrk2.run(target.direct, rate, seconds, connections=64).quantile(0.5))
            before = cpu_seconds(pid) if pid else 0.0
            run = _wrk2.run(target.url, rate, seconds, connections=64)
            hop.append(run.quantile(0.5))
            cpu.append((cpu_seconds(pid) - before) / max(run.total, 1) * 1e6 if pid else 0.0)
        out[target.name] = (
            statistics.median(hop) - statistics.median(direct),
            statistics.median(cpu),
        )
    return out


def overload(target: Target, capacity: float, seconds: float, factors: tuple[float, ...]) -> None:
    for factor in factors:
        run = _wrk2.run(target.url, capacity * factor, seconds, connections=1000)
        target.runs[f"{factor:g}x"] = run
        time.sleep(5.0)  # the overload is over: 5 s later, half the capacity
        target.runs[f"after {factor:g}x"] = _wrk2.run(
            target.url, capacity / 2, seconds, 64, count=(0.0, 1e12)
        )


def bench_beside(url: str, rate: float, seconds: float, out: Path) -> dict[str, float]:
    """`tailserve bench` at ``rate`` (the Python generator, one process)."""
    workload = Path(__file__).resolve().parent / "workloads" / "churn-unique.yaml"
    command = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "bench",
        str(workload),
        "--target",
        url,
        "--rate",
        str(rate),
        "--duration",
        str(seconds),
        "--warmup",
        "0",
        "--out",
        str(out),
        "--quiet",
    ]
    subprocess.run(command, check=True, **QUIET)
    import orjson

    overall = orjson.loads(out.read_bytes())["overall"]
    return {
        "p99_ms": overall["p99_ms"] or 0.0,
        "errors": overall["errors"],
        "achieved_rps": overall["achieved_rps"],
    }


def contention(repository: Path, clean: float, seconds: float) -> dict[str, _wrk2.Run]:
    """A fresh worker at 0.6x its clean capacity with neighbours burning a core, then without."""
    runs = {}
    with lone_worker(repository) as fresh:
        with neighbours():
            runs["with neighbours"] = _wrk2.run(fresh.url, 0.6 * clean, seconds, 64)
        runs["first 5 s after"] = _wrk2.run(
            fresh.url, 0.6 * clean, seconds, 64, count=(0.0, 5000.0)
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds a run")
    parser.add_argument(
        "--step-seconds", type=float, default=5.0, help="measured seconds a capacity step"
    )
    parser.add_argument("--skip-contention", action="store_true")
    args = parser.parse_args()
    _wrk2.binary()
    with tempfile.TemporaryDirectory() as tmp:
        every = examples(Path(tmp) / "examples")
        repository = one_model(every / "churn", Path(tmp) / "churn-only")
        with lone_worker(repository) as alone, stack(repository) as door, routed(repository) as py:
            targets = [alone, door, py]
            print("SLO capacity (p99 <= 50 ms, no error), 64 connections, in turns:")
            capacities(targets, args.step_seconds)
            caps = {t.name: t.search.capacity_rps or 0.0 for t in targets}
            one = caps["worker"]
            costs = hop_costs(targets, max(500.0, one / 4), args.seconds)
            for target in (door, py, alone):
                overload(target, one, args.seconds, (2.0, 3.0))
            bench = bench_beside(door.url, one / 2, args.seconds, Path(tmp) / "bench.json")
        squeezed = {} if args.skip_contention else contention(repository, one, args.seconds)
    report(targets, caps, costs, bench, squeezed, one)


def report(
    targets: list[Target],
    caps: dict[str, float],
    costs: dict[str, tuple[float, float]],
    bench: dict[str, float],
    squeezed: dict[str, _wrk2.Run],
    one: float,
) -> None:
    print("\n| configuration | SLO capacity | vs one worker | hop's added p50 | hop CPU/request |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for target in targets:
        added, cpu = costs.get(target.name, (0.0, 0.0))
        hop = f"{added * 1000:+.0f} us | {cpu:.0f} us" if target.name in costs else "- | -"
        print(
            f"| {target.name} | {caps[target.name]:,.0f} | {caps[target.name] / one:.2f}x | {hop} |"
        )
    print(
        "\nOverload over 1,000 connections (goodput: 200s within the SLO a second, / one "
        "worker's capacity); then half of one worker's capacity, 5 s later, 64 connections:"
    )
    print("| configuration | offered | goodput | x capacity | p99 | 429 | 503 | other |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for target in targets:
        for label, run in target.runs.items():
            good = run.goodput(SLO_MS)
            print(
                f"| {target.name} {label} | {run.rate:,.0f} | {good:,.0f} | {good / one:.2f} | "
                f"{run.quantile(0.99):.1f} ms | {run.refused} | {run.unavailable} | "
                f"{run.other + run.socket_errors} |"
            )
    print(
        f"\n`tailserve bench` beside it (stack, {one / 2:,.0f} req/s): p99 "
        f"{bench['p99_ms']:.1f} ms, errors {bench['errors']}, achieved "
        f"{bench['achieved_rps']:,.0f} req/s"
    )
    if squeezed:
        print("\nA fresh worker at 0.6x its clean capacity:")
        during = squeezed["with neighbours"]
        print(
            f"  with neighbours: goodput / offered {during.goodput(SLO_MS) / during.rate:.2f}, "
            f"p99 {during.quantile(0.99):.1f} ms, 429 {during.refused}"
        )
        after = squeezed["first 5 s after"]
        print(
            f"  after they stop: 429 in the first 5 s {after.refused} (200s {after.ok}), "
            f"p99 of the window after {after.quantile(0.99):.1f} ms"
        )


if __name__ == "__main__":
    main()
