"""What the load generator's timer does to the latency it measures, side by side in one run.

The same Poisson load at one fixed rate, sent by `tailserve bench` with the event loop's
millisecond timers (``--timer loop``) and with its fine timer (a timerfd, the default), in
alternation (``--rounds`` each), against two servers, each fresh for every run:

- the measuring floor: a fixed reply on the worker's own HTTP stack
  (benchmarks/baselines/fixed_reply.py);
- the cache's hit path: a worker with L1 (W-TinyLFU) + Redis serving churn, Zipf(1.0) over
  10,000 customers, every one of them asked for twice before the run (the first miss fills L1,
  the first hit the reply memo), so that the run measures the path every hit takes in service.

Printed: p50 / p99 / p99.9 as the generator measures them, its CPU share and lag, and the
worker's own CPU a request (from /proc), medians over the rounds, and the loop timer's figures
over the fine one's.

    python benchmarks/generator_timer.py [--rate 7500] [--duration 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as h

TIMERS = ("loop", "fine")
SERVERS = ("fixed-reply", "hit-path")
CUSTOMERS = 10_000
PREFILL_RPS = 1000.0
CACHE = {
    "enabled": True,
    "ttl_s": 600,
    "stale_s": 60,
    "l1": {"max_entries": 100_000, "max_bytes": 256 * 1024 * 1024, "policy": "tinylfu"},
}
FIELDS = ("p50_ms", "p99_ms", "p999_ms")


def prefill(spec: Path, out: Path, port: int) -> None:
    """Ask for each customer twice: L1 takes the first answer, the reply memo the second."""
    fill = h.workload(
        spec.name,
        out,
        where=spec.parent,
        name="prefill",
        target=f"http://127.0.0.1:{port}",
        keys={"space": "unique"},
    )
    seconds = CUSTOMERS / PREFILL_RPS * 1.02
    for _ in range(2):
        h.bench(
            fill,
            out / "prefill.json",
            "--rate",
            str(PREFILL_RPS),
            "--duration",
            f"{seconds:.2f}",
            "--warmup",
            "0",
            echo=False,
        )


def one(
    server: str, timer: str, index: int, work: Path, redis_url: str, args: argparse.Namespace
) -> dict[str, Any]:
    port = h.free_port()
    model_config = work / "repo" / "churn" / "model.yaml"
    spec = h.workload(
        "churn-zipf1m.yaml",
        args.out,
        name=f"{server}-{timer}-{index}",
        target=f"http://127.0.0.1:{port}",
        model_config=str(model_config),
        keys={"space": "zipf", "size": CUSTOMERS, "s": 1.0},
    )
    if server == "fixed-reply":
        command = [
            sys.executable,
            str(h.HERE / "baselines" / "fixed_reply.py"),
            "--port",
            str(port),
        ]
    else:
        h.redis_command(redis_url, "FLUSHALL")
        command = h.worker(work / "repo", port, "--redis-url", redis_url)
    with h.server_process(command, port) as (_, process):
        if server == "hit-path":
            prefill(spec, args.out, port)
        pid = process.pid
        cpu_before = h.cpu_seconds(pid)
        result = h.bench(
            spec,
            args.out / f"{server}-{timer}-{index}.json",
            "--rate",
            str(args.rate),
            "--duration",
            str(args.duration),
            "--warmup",
            str(args.warmup),
            "--timer",
            timer,
            "--name",
            f"{server}-{timer}",
            echo=False,
        )
        cpu = h.cpu_seconds(pid) - cpu_before
    overall, generator = result["overall"], result["generator"]
    sent = overall["count"] * (1.0 + args.warmup / args.duration)
    row = {field: overall[field] for field in FIELDS}
    row["errors"] = overall["errors"]
    row["generator_cpu"] = generator["cpu_share"]
    row["lag_p99_ms"] = generator["lag_p99_ms"]
    row["server_cpu_us"] = cpu / max(sent, 1.0) * 1e6
    print(
        f"{server:12} {timer:5} round {index + 1}: "
        + ", ".join(f"{k} {v:.3g}" for k, v in row.items()),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate",
        type=float,
        default=7500.0,
        help="req/s (default: about half the hit path's capacity here)",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "generator_timer")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples = h.examples(work / "examples")
        h.one_model(examples / "churn", work / "repo", cache=CACHE)
        with h.redis(work) as redis_url:
            for index in range(args.rounds):
                for server in SERVERS:
                    for timer in TIMERS:
                        row = one(server, timer, index, work, redis_url, args)
                        rows.setdefault((server, timer), []).append(row)
    columns = (*FIELDS, "generator_cpu", "lag_p99_ms", "server_cpu_us")
    print(f"\n{args.rate:,.0f} req/s, {args.duration:g} s a run; medians of {args.rounds} rounds")
    head = f"{'server':13}{'timer':7}" + "".join(f"{c:>15}" for c in columns) + f"{'errors':>8}"
    print(head + "\n" + "-" * len(head))
    medians: dict[tuple[str, str], dict[str, float]] = {}
    for (server, timer), results in rows.items():
        medians[server, timer] = {c: statistics.median(r[c] for r in results) for c in columns}
        errors = sum(int(r["errors"]) for r in results)
        print(
            f"{server:13}{timer:7}"
            + "".join(f"{medians[server, timer][c]:>15.3g}" for c in columns)
            + f"{errors:>8}"
        )
    for server in SERVERS:
        loop, fine = medians[server, "loop"], medians[server, "fine"]
        print(
            f"{server}: loop timer / fine timer: "
            + ", ".join(
                f"{field} {loop[field] / fine[field]:.2f}x" for field in FIELDS if fine[field]
            )
        )


if __name__ == "__main__":
    main()
