"""Batching policies side by side in one run, measured with `tailserve bench`.

Policies: the deadline batcher (cost classes, earliest deadline first, admission by what can
be met), size-or-timeout at 2 ms and at 50 ms max delay (with padding to the longest request
in the batch, where the model pads), and no batching. Models: ``churn`` with unique inputs
(benchmarks/workloads/churn-unique.yaml, SLO 50 ms) and ``sentiment``, whose cost grows with a
review's length, lengths skewed (sentiment-skewed.yaml, SLO 100 ms). Each policy serves one
model in its own worker, one at a time (they would share the two cores).

For each: the SLO capacity (p99 under the SLO, no errors); p99, batch efficiency (rows per
batch over the maximum) and SLO misses at one equal offered load (70% of the deadline
batcher's capacity); then overload at 3x the policy's own SLO capacity (or the deadline
batcher's, where a policy has none): goodput, the requests answered within the SLO a second.

    python benchmarks/batching_policies.py [--models churn,sentiment] [--duration 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import orjson

import _harness as h

POLICIES: dict[str, dict[str, Any]] = {
    "deadline": {"policy": "deadline"},
    "size-or-timeout-2ms": {"policy": "size_or_timeout", "max_queue_delay_ms": 2},
    "size-or-timeout-50ms": {"policy": "size_or_timeout", "max_queue_delay_ms": 50},
    "no-batching": {"policy": "none"},
}
MODELS = {
    "churn": ("churn-unique.yaml", 1000.0, 256),
    "sentiment": ("sentiment-skewed.yaml", 500.0, 64),
}


def measure(model: str, policy: str, examples: Path, work: Path, out: Path,
            args: argparse.Namespace, reference: float | None) -> dict[str, Any]:  # fmt: skip
    """One policy's figures; ``reference``: the deadline batcher's capacity, once known."""
    workload_file, start_rps, max_rows = MODELS[model]
    # No result cache: this compares batchers on work that must be computed.
    repo = h.one_model(examples / model, work / f"{model}-{policy}", POLICIES[policy], cache={})
    port = h.free_port()
    name = f"{model}-{policy}"
    spec = h.workload(workload_file, out, name=name, target=f"http://127.0.0.1:{port}",
                      schedule={"kind": "poisson", "rate": start_rps})  # fmt: skip
    timing = ["--duration", str(args.duration), "--warmup", str(args.warmup)]
    print(f"\n=== {model}: {policy} ===", flush=True)
    with h.serving(h.worker(repo, port), port):
        capacity = h.bench(spec, out / f"{name}.json", "--find-capacity", "--name", policy,
                           "--report", str(out / f"{name}.html"), *timing)  # fmt: skip
        own = (capacity["capacity"] or {}).get("rps")
        anchor = reference or own or start_rps
        equal_rate = 0.7 * anchor
        equal = h.bench(spec, out / f"{name}-equal.json", "--rate", f"{equal_rate:.0f}",
                        "--name", policy, *timing, echo=False)  # fmt: skip
        overload_rate = min(3 * (own or anchor), args.max_rate)
        overload = h.bench(spec, out / f"{name}-overload.json", "--rate",
                           f"{overload_rate:.0f}", "--name", policy, *timing,
                           echo=False)  # fmt: skip
    served = equal.get("server") or {}
    return {
        "capacity": own,
        "equal_rps": equal_rate,
        "equal": equal["overall"],
        "efficiency": (served.get("batch_size_mean") or 0.0) / max_rows,
        "overload_rps": overload_rate,
        "overload": overload["overall"],
        "generator_behind": overload["generator"]["behind"] or overload["generator"]["cpu_bound"],
    }


def report(model: str, results: dict[str, dict[str, Any]]) -> None:
    slo = {"churn": 50, "sentiment": 100}[model]
    print(f"\n{model}: SLO p99 <= {slo} ms")
    head = (
        f"{'policy':22}{'capacity':>10}{'vs deadline':>12}{'p99@equal':>11}"
        f"{'rows/max':>9}{'SLO miss':>9}{'overload':>10}{'goodput':>9}{'/capacity':>10}"
    )
    print(head)
    print("-" * len(head))
    best = results["deadline"]["capacity"] or 0.0
    for policy, r in results.items():
        capacity = r["capacity"]
        equal, over = r["equal"], r["overload"]
        ratio = f"{capacity / best:.2f}x" if capacity and best else "-"
        cap_text = f"{capacity:,.0f}" if capacity else "none"
        share = r["overload"]["goodput_rps"] / (capacity or best or 1.0)
        p99 = f"{equal['p99_ms']:.1f}" if equal["p99_ms"] is not None else "-"
        print(
            f"{policy:22}{cap_text:>10}{ratio:>12}{p99:>11}{r['efficiency']:>9.2f}"
            f"{equal['slo_misses'] + equal['errors']:>9,}{r['overload_rps']:>10,.0f}"
            f"{over['goodput_rps']:>9,.0f}{share:>10.2f}"
            f"{'  (generator behind)' if r['generator_behind'] else ''}"
        )
    equal_rps = results["deadline"]["equal_rps"]
    print(
        f"equal load: {equal_rps:,.0f} req/s; overload: 3x each policy's capacity "
        "(the deadline batcher's where a policy has none); SLO miss: answered late or failed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="churn,sentiment")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per step")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--max-rate", type=float, default=15000.0,
                        help="the most one generator process is asked to offer")  # fmt: skip
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "batching_policies")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tailserve-batching-"))
    examples = h.examples(work / "examples")
    summary = {}
    for model in args.models.split(","):
        results: dict[str, dict[str, Any]] = {}
        for policy in args.policies.split(","):
            reference = results["deadline"]["capacity"] if "deadline" in results else None
            results[policy] = measure(model, policy, examples, work, args.out, args, reference)
        summary[model] = results
        if len(results) > 1:
            h.compare([args.out / f"{model}-{p}.json" for p in results],
                      args.out / f"{model}-compare.html")  # fmt: skip
    print("\n\nSummary")
    for model, results in summary.items():
        report(model, results)
    (args.out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(f"\nresults and reports: {args.out}")


if __name__ == "__main__":
    main()
