"""Scale out on one machine: a step load 1x -> 4x -> 1x of a quarter of the stack's SLO capacity,
against three stacks side by side (churn with unique inputs, p99 <= 50 ms):

- `fixed`: `tailserve up --workers 1`, a single worker;
- `cold`: `tailserve up --min-workers 1 --max-workers 2 --scale-down-after 20`, autoscaling
  from cold;
- `warm`: the same with `--warm-pool 1`, a warm standby to promote.

The load comes from wrk2 (open loop, C): one run at 1x for the whole time and a second at 3x
during the step. `tailserve bench` sends a thin probe beside them (100 req/s), whose
per-second p99 is the curve users meet. Each second the script also reads the stack's
`/v2/fleet` (the workers' states) and the front door's counters.

For each stack it reports:

- the seconds from the step until the probe's p99 is back within the SLO for good;
- the refusals (503s);
- the requests that failed while a worker drained (must be 0);
- the cold start and the promotion;
- the probe's p99 over time, a plot (autoscale.png beside the result).

    python benchmarks/autoscale.py [--capacity RPS] [--out DIR]

Without `--capacity`, the stack's capacity (`up --workers 2`) is searched first (about 3 min).
Needs wrk2 on the PATH (see benchmarks/_wrk2.py). Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

import _wrk2
from _harness import QUIET, examples, get_json, one_model, up_stack
from tailserve.fleet.load import parse_stat

SLO_MS = 50.0
LOW_S, HIGH_S, AFTER_S = 20.0, 30.0, 100.0  # the step: 1x, 4x, 1x
PROBE_RPS = 100.0
# A worker leaves after 20 s in which fewer would have done (60 by default): the scale-down
# falls inside the run, under the 1x load.
SCALING = ["--min-workers", "1", "--max-workers", "2", "--scale-down-after", "20"]
STACKS = {
    "fixed": ["--workers", "1"],
    "cold": SCALING,
    "warm": [*SCALING, "--warm-pool", "1"],
}


@dataclass
class Outcome:
    name: str
    timeline: list[dict[str, Any]] = field(default_factory=list)  # the probe's, per second
    fleet: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (t, /v2/fleet)
    door: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (t, counters)
    base: _wrk2.Run | None = None
    step: _wrk2.Run | None = None


@contextlib.contextmanager
def stack(repository: Path, flags: list[str]) -> Iterator[str]:
    with up_stack(repository, *flags) as url:
        if "--warm-pool" in flags:
            until(lambda: any(w["state"] == "standby" for w in fleet(url)["workers"]), 120)
        yield url


def fleet(url: str) -> dict[str, Any]:
    document: dict[str, Any] = get_json(f"{url}/v2/fleet")
    return document


def until(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.2)


def door_counters(url: str) -> dict[str, float]:
    """The front door's frontend counters, from HAProxy's master socket."""
    config = Path(fleet(url)["front_door"]["config"])
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(config.parent / "master.sock"))
        sock.sendall(b"@1 show stat -1 1 -1\n")
        sock.shutdown(socket.SHUT_WR)
        text = b"".join(iter(lambda: sock.recv(65536), b"")).decode()
    totals: dict[str, float] = {}
    for (proxy, server), row in parse_stat(text).items():
        if server == "FRONTEND" and proxy == "http":
            for key in ("hrsp_2xx", "hrsp_5xx", "req_tot"):
                totals[key] = totals.get(key, 0.0) + float(row.get(key) or 0)
    return totals


def watch(url: str, outcome: Outcome, stop: threading.Event, started: float) -> None:
    while not stop.is_set():
        t = time.monotonic() - started
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            outcome.fleet.append((t, fleet(url)))
            outcome.door.append((t, door_counters(url)))
        stop.wait(1.0)


def probe(url: str, seconds: float, out: Path) -> subprocess.Popen[bytes]:
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
        str(PROBE_RPS),
        "--duration",
        str(seconds),
        "--warmup",
        "0",
        "--out",
        str(out),
        "--quiet",
    ]
    return subprocess.Popen(command, **QUIET)


def step_load(url: str, quarter: float, out: Path, name: str) -> Outcome:
    """The step against one stack: wrk2 at 1x throughout (its calibration first), wrk2 at 3x
    more during the step, the probe beside them; t = 0 when the probe starts."""
    outcome = Outcome(name)
    calibration = _wrk2.CALIBRATION_MS / 1000 + 1
    total = LOW_S + HIGH_S + AFTER_S
    results: dict[str, _wrk2.Run] = {}

    def base() -> None:
        results["base"] = _wrk2.run(url, quarter, total, connections=64, threads=1)

    def high() -> None:
        # Its own calibration is part of the step: it sends at its rate all along.
        results["step"] = _wrk2.run(
            url, 3 * quarter, HIGH_S - calibration, connections=64, threads=1
        )

    base_thread = threading.Thread(target=base)
    base_thread.start()
    time.sleep(calibration)
    started = time.monotonic()
    probe_out = out / f"{name}-probe.json"
    prober = probe(url, total, probe_out)
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(url, outcome, stop, started))
    watcher.start()
    time.sleep(max(0.0, LOW_S - (time.monotonic() - started)))
    high_thread = threading.Thread(target=high)
    high_thread.start()
    high_thread.join()
    base_thread.join()
    prober.wait()
    stop.set()
    watcher.join()
    outcome.base, outcome.step = results.get("base"), results.get("step")
    outcome.timeline = orjson.loads(probe_out.read_bytes()).get("timeline") or []
    return outcome


def absorbed(outcome: Outcome) -> float | None:
    """Seconds from the step until the probe's p99 stays within the SLO to the step's end."""
    inside = [p for p in outcome.timeline if LOW_S <= p["t"] < LOW_S + HIGH_S]
    late = [p["t"] for p in inside if (p.get("p99_ms") or 0) > SLO_MS]
    if not late:
        return 0.0
    last = max(late) + 1 - LOW_S
    return None if last >= HIGH_S else last


def scale_down_failures(outcome: Outcome) -> tuple[float | None, float]:
    """When the fleet shrank (s from the start), and the 5xx answers the front door gave from
    2 s before it to 10 s after (its counters, read each second); (None, 0) if it never did."""
    counts = serving_over_time(outcome)
    shrank = next((t for (_, m), (t, n) in itertools.pairwise(counts) if n < m), None)
    if shrank is None:
        return None, 0.0
    window = [c.get("hrsp_5xx", 0.0) for t, c in outcome.door if shrank - 2 <= t <= shrank + 10]
    # A reload of the front door (after each change) starts its counters again from 0.
    steps = [b - a if b >= a else b for a, b in itertools.pairwise(window)]
    return shrank, float(sum(steps))


def serving_over_time(outcome: Outcome) -> list[tuple[float, int]]:
    return [
        (t, sum(w["state"] == "serving" for w in document["workers"]))
        for t, document in outcome.fleet
    ]


def plot(outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for outcome in outcomes:
        t = [p["t"] for p in outcome.timeline]
        top.plot(t, [p.get("p99_ms") or 0 for p in outcome.timeline], label=outcome.name)
        counts = serving_over_time(outcome)
        bottom.step([c[0] for c in counts], [c[1] for c in counts], label=outcome.name)
    top.axhline(SLO_MS, color="grey", linestyle=":", label="SLO")
    for axis in (top, bottom):
        axis.axvspan(LOW_S, LOW_S + HIGH_S, color="grey", alpha=0.1)
        axis.legend()
    top.set_yscale("log")
    top.set_ylabel("probe p99 (ms)")
    bottom.set_ylabel("serving workers")
    bottom.set_xlabel("seconds (4x between the lines)")
    figure.tight_layout()
    figure.savefig(path)


def report(outcomes: list[Outcome], quarter: float, out: Path) -> None:
    print(f"\nstep: {quarter:.0f} -> {4 * quarter:.0f} -> {quarter:.0f} req/s (wrk2, 64 conn)")
    print(
        "\n| stack | absorbed the step in | p99 in the step (wrk2 3x) | refusals (503) "
        "| scaled down at | 5xx around it | serving at the end | cold start | promotion |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for o in outcomes:
        took = absorbed(o)
        refused = sum(r.unavailable + r.refused for r in (o.base, o.step) if r is not None)
        shrank, failed = scale_down_failures(o)
        last = o.fleet[-1][1] if o.fleet else {"workers": [], "autoscaler": None}
        scaler = last.get("autoscaler") or {}
        cold = scaler.get("cold_start_s")
        promoted = scaler.get("promotion_s")
        serving = sum(w["state"] == "serving" for w in last["workers"])
        p99 = o.step.quantile(0.99) if o.step else float("nan")
        print(
            f"| {o.name} | {'never' if took is None else f'{took:.0f} s'} | {p99:.1f} ms "
            f"| {refused} | {'-' if shrank is None else f'{shrank:.0f} s'} | {failed:.0f} "
            f"| {serving} "
            f"| {'-' if cold is None else f'{cold:.1f} s'} "
            f"| {'-' if promoted is None else f'{promoted * 1e3:.1f} ms'} |"
        )
    samples = {o.name: {"fleet": o.fleet, "door": o.door, "probe": o.timeline} for o in outcomes}
    (out / "autoscale-samples.json").write_bytes(orjson.dumps(samples))
    plot(outcomes, out / "autoscale.png")
    print(f"\nplot: {out / 'autoscale.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=float, help="the stack's SLO capacity (req/s)")
    parser.add_argument("--out", type=Path, help="where the results go (default: a temp dir)")
    parser.add_argument("--only", default=",".join(STACKS), help="stacks to run, in order")
    args = parser.parse_args()
    _wrk2.binary()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        every = examples(Path(tmp) / "examples")
        repository = one_model(every / "churn", Path(tmp) / "churn-only")
        rps = args.capacity
        if rps is None:
            print("SLO capacity of `tailserve up --workers 2` (p99 <= 50 ms, 64 connections):")
            with stack(repository, ["--workers", "2"]) as url:
                rps = _wrk2.slo_capacity(url, 5.0, SLO_MS)
            print(f"  capacity {rps:.0f} req/s")
        quarter = rps / 4
        outcomes = []
        for name in args.only.split(","):
            print(f"{name}: {' '.join(STACKS[name])}", flush=True)
            with stack(repository, STACKS[name]) as url:
                outcomes.append(step_load(url, quarter, out, name))
        report(outcomes, quarter, out)


if __name__ == "__main__":
    main()
