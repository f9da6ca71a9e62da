"""The GIL switch interval's effect on a busy worker, side by side in one run.

A model's instance thread needs the GIL briefly for each batch (taking it, converting it,
handing the results back), and while the event loop is busy it waits for the loop to give the
GIL up: at most the interpreter's switch interval (5 ms unless set). ``churn`` with unique
inputs and the deadline batcher, at a fixed rate near its capacity, served by a worker with
Python's interval (``--gil-switch-interval-ms 0``) and by one with the default 0.5 ms, in
alternation (``--rounds`` each), each round a fresh worker: the batch time (compute) p50 / p99
the worker reports, its queue p99, the client's p50 / p99 and the goodput (answers within the
SLO a second; past capacity, what admission control keeps). ``--model sentiment`` (lengths
skewed, a costlier model) checks that the shorter interval costs a heavier model nothing.

    python benchmarks/gil_switch.py [--model churn|sentiment] [--rate R] [--duration 15]
                                    [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import _harness as h

CONFIGS = {"python-5ms": "0", "tailserve-0.5ms": "0.5"}
# Each model's workload, and a rate near its capacity on these machines (2 cores).
MODELS = {"churn": ("churn-unique.yaml", 2400.0), "sentiment": ("sentiment-skewed.yaml", 1500.0)}
FIELDS = (
    ("compute_p50_ms", "server"),
    ("compute_p99_ms", "server"),
    ("queue_p99_ms", "server"),
    ("p50_ms", "overall"),
    ("p99_ms", "overall"),
    ("goodput_rps", "overall"),
)


def one(
    repository: Path, out: Path, name: str, interval: str, args: argparse.Namespace, index: int
) -> dict[str, Any]:
    port = h.free_port()
    spec = h.workload(
        MODELS[args.model][0],
        out,
        name=f"{args.model}-{name}-{index}",
        target=f"http://127.0.0.1:{port}",
        schedule={"kind": "poisson", "rate": args.rate},
    )
    command = h.worker(repository, port, "--gil-switch-interval-ms", interval)
    with h.serving(command, port):
        result = h.bench(
            spec,
            out / f"{args.model}-{name}-{index}.json",
            "--rate",
            str(args.rate),
            "--duration",
            str(args.duration),
            "--warmup",
            str(args.warmup),
            "--name",
            name,
            echo=False,
        )
    row = {field: (result.get(part) or {}).get(field) for field, part in FIELDS}
    row["errors"] = result["overall"]["errors"]
    row["behind"] = result["generator"]["behind"]
    print(
        f"{name:18} round {index + 1}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True
    )
    return row


def main() -> None:
    parser = h.rounds_parser(
        __doc__,
        list(MODELS),
        "gil_switch",
        duration=15.0,
        rate_help="default: near the model's capacity",
    )
    args = h.rounds_args(parser, {model: rate for model, (_, rate) in MODELS.items()})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples = h.examples(work / "examples")
        repository = h.one_model(examples / args.model, work / "repo", {"policy": "deadline"}, {})
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
        for index in range(args.rounds):
            for name, interval in CONFIGS.items():
                rows[name].append(one(repository, args.out, name, interval, args, index))
    print(
        f"\n{args.model}, deadline batcher, {args.rate:,.0f} req/s offered, {args.duration:g} s "
        f"a round; medians of {args.rounds} rounds (ms)"
    )
    head = f"{'config':18}" + "".join(f"{field:>16}" for field, _ in FIELDS) + f"{'errors':>8}"
    print(head + "\n" + "-" * len(head))
    medians: dict[str, dict[str, float]] = {}
    for name, results in rows.items():
        medians[name] = {
            field: statistics.median(float(r[field]) for r in results if r[field] is not None)
            for field, _ in FIELDS
        }
        errors = sum(int(r["errors"]) for r in results)
        print(
            f"{name:18}" + "".join(f"{medians[name][f]:>16.2f}" for f, _ in FIELDS) + f"{errors:>8}"
        )
    base, new = medians["python-5ms"], medians["tailserve-0.5ms"]
    print(
        "ratio (5 ms / 0.5 ms): "
        + ", ".join(f"{field} {base[field] / new[field]:.2f}x" for field, _ in FIELDS if new[field])
    )
    if any(r["behind"] for results in rows.values() for r in results):
        print("(the load generator fell behind in a round: rerun before reading the figures)")


if __name__ == "__main__":
    main()
