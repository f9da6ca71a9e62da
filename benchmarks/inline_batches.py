"""Cheap batches on the event loop's thread or handed to the instance's, side by side in one run.

A batch the cost model predicts to take at most ``instances.inline_below_ms`` runs on the loop
(docs/worker.md); handing it to the instance's thread costs a queue put, a thread wake-up, the
GIL changing hands twice and a wake-up of the loop for the result. A worker with the bound at
``--bound-ms`` ("loop") and one with it at 0 ("thread") serve the same fixed rate in
alternation (``--rounds`` each), each round a fresh worker, with the deadline batcher: the
worker's CPU time per request answered (both threads), the mean batch, the batches run on the
loop, the client's p50 / p99 and the goodput (answers within the SLO a second). ``churn``
(unique inputs, no cache: every request computed) near its capacity is where it pays;
``--model sentiment --rate 5000`` (3x overload) checks that a costlier model's goodput does not
suffer from the few batches cheap enough.

    python benchmarks/inline_batches.py [--model churn|sentiment] [--rate R] [--bound-ms 0.2]
                                        [--duration 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

import _harness as h

# Each model's workload, and a default rate (churn: near capacity; sentiment: 3x overload).
MODELS = {"churn": ("churn-unique.yaml", 2400.0), "sentiment": ("sentiment-skewed.yaml", 5000.0)}
FIELDS = ("cpu_us", "batch_rows", "inline_share", "p50_ms", "p99_ms", "goodput_rps")


def repository(examples: Path, into: Path, model: str, bound_ms: float) -> Path:
    repo = h.one_model(examples / model, into, {"policy": "deadline"}, {})
    path = repo / model / "model.yaml"
    config = yaml.safe_load(path.read_text())
    config.setdefault("instances", {})["inline_below_ms"] = bound_ms
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repo


def one(repo: Path, out: Path, name: str, args: argparse.Namespace, index: int) -> dict[str, Any]:
    port = h.free_port()
    spec = h.workload(
        MODELS[args.model][0],
        out,
        name=f"{args.model}-{name}-{index}",
        target=f"http://127.0.0.1:{port}",
        schedule={"kind": "poisson", "rate": args.rate},
    )
    with h.server_process(h.worker(repo, port), port) as (url, process):
        before = h.cpu_seconds(process.pid)
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
        used = h.cpu_seconds(process.pid) - before
        batching = h.get_json(f"{url}/v2/models/{args.model}/stats")["model_stats"][0]
    overall, server = result["overall"], result.get("server") or {}
    batches = sum(b["compute_infer"]["count"] for b in batching["batch_stats"])
    row = {
        # The bench's warm-up is in the CPU time but not in the count: a small overstatement,
        # the same for both.
        "cpu_us": used / max(1, overall["count"]) * 1e6,
        "batch_rows": server.get("batch_size_mean") or 0.0,
        "inline_share": batching["batching"]["inline_batches"] / max(1, batches),
        "p50_ms": overall["p50_ms"],
        "p99_ms": overall["p99_ms"],
        "goodput_rps": overall["goodput_rps"],
        "errors": overall["errors"],
        "behind": result["generator"]["behind"],
    }
    print(
        f"{name:8} round {index + 1}: "
        + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
        flush=True,
    )
    return row


def main() -> None:
    parser = h.rounds_parser(
        __doc__,
        list(MODELS),
        "inline_batches",
        duration=10.0,
        rate_help="default: churn 2,400, sentiment 5,000",
    )
    parser.add_argument("--bound-ms", type=float, default=0.2, help="the loop's bound")
    args = h.rounds_args(parser, {model: rate for model, (_, rate) in MODELS.items()})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples = h.examples(work / "examples")
        repos = {
            "loop": repository(examples, work / "loop", args.model, args.bound_ms),
            "thread": repository(examples, work / "thread", args.model, 0.0),
        }
        rows = alternate(repos, args)
    print(
        f"\n{args.model}, deadline batcher, {args.rate:,.0f} req/s offered, {args.duration:g} s "
        f"a round, loop bound {args.bound_ms:g} ms; medians of {args.rounds} rounds"
    )
    medians = table(rows)
    loop, thread = medians["loop"], medians["thread"]
    print(
        f"CPU a request, thread / loop: {thread['cpu_us'] / loop['cpu_us']:.2f}x; "
        f"goodput, loop / thread: {loop['goodput_rps'] / max(1e-9, thread['goodput_rps']):.2f}x"
    )
    if any(r["behind"] for results in rows.values() for r in results):
        print("(the load generator fell behind in a round: rerun before reading the figures)")


def alternate(repos: dict[str, Path], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``args.rounds`` rounds of each repository's worker, in turn (the order reversed every
    other round): each configuration's rows, by name."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in repos}
    for index in range(args.rounds):
        order = list(repos) if index % 2 == 0 else list(reversed(repos))
        for name in order:
            rows[name].append(one(repos[name], args.out, name, args, index))
    return rows


def table(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Print each configuration's medians over its rounds (and its errors, summed); return
    the medians."""
    width = max(8, *map(len, rows))
    head = f"{'config':{width}}" + "".join(f"{field:>14}" for field in FIELDS) + f"{'errors':>8}"
    print(head + "\n" + "-" * len(head))
    medians: dict[str, dict[str, float]] = {}
    for name, results in rows.items():
        medians[name] = {f: statistics.median(float(r[f]) for r in results) for f in FIELDS}
        errors = sum(int(r["errors"]) for r in results)
        print(
            f"{name:{width}}"
            + "".join(f"{medians[name][f]:>14.2f}" for f in FIELDS)
            + f"{errors:>8}"
        )
    return medians


if __name__ == "__main__":
    main()
