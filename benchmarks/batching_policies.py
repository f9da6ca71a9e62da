"""Batching policies side by side in one run, measured with `tailserve bench`.

Policies: the deadline batcher (cost classes, earliest deadline first, admission by what can
be met), size-or-timeout at 2 ms and at 50 ms max delay (with padding to the longest request
in the batch, where the model pads), and no batching. Models: ``churn`` with unique inputs
(benchmarks/workloads/churn-unique.yaml, SLO 50 ms) and ``sentiment``, whose cost grows with a
review's length, lengths skewed (sentiment-skewed.yaml, SLO 100 ms). Each policy serves one
model in its own worker.

For each: the SLO capacity (p99 under the SLO, no errors); p99, batch efficiency (rows per
batch over the maximum) and SLO misses at one equal offered load (70% of the deadline
batcher's capacity); then overload at 3x the policy's own SLO capacity (or the deadline
batcher's, where a policy has none): goodput, the requests answered within the SLO a second.

The policies take turns, one step each: every policy's worker runs from the start, and the
capacity searches (`loadgen.capacity.CapacitySearch`, as `tailserve bench --find-capacity`
runs it) advance one step at a time in rotation, then the equal loads, then the overloads.
Only one worker has load at a time (they would share the two cores), and before each step
the last one's queue is let drain. Run one policy after the other, as this once did, a
search took minutes and the machine's speed moved in between: churn's capacity moved from
8,250 to 5,750 req/s within an hour, so the ratios measured the clock as much as the policies.

    python benchmarks/batching_policies.py [--models churn,sentiment] [--duration 5]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

import _harness as h
from tailserve.loadgen.capacity import CapacitySearch, Step

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
# A step's arrivals: the workload's seed plus this times the step's number (as `tailserve
# bench` varies them between the steps of a search).
STEP_SEED = 1000


class Policy:
    """One policy's worker serving one model, and its runs of `tailserve bench`."""

    def __init__(
        self,
        model: str,
        policy: str,
        examples: Path,
        work: Path,
        out: Path,
        args: argparse.Namespace,
    ) -> None:
        self.model, self.policy, self.out, self.args = model, policy, out, args
        workload_file, start_rps, _ = MODELS[model]
        # The SLO the workload states (its p99 is what the searches hold the policies to).
        self.slo_ms = float(
            yaml.safe_load((h.WORKLOADS / workload_file).read_text())["slo"]["p99_ms"]
        )
        # No result cache: this compares batchers on work that must be computed.
        self.repo = h.one_model(
            examples / model, work / f"{model}-{policy}", POLICIES[policy], cache={}
        )
        self.port = h.free_port()
        self.name = f"{model}-{policy}"
        self.workload_file = workload_file
        self.search = CapacitySearch(slo_ms=self.slo_ms, start_rps=start_rps, precision=0.05)
        self.steps = 0

    def run(self, rate: float, result: Path) -> dict[str, Any]:
        """One run at ``rate`` req/s, new arrivals each time; its result document."""
        self.steps += 1
        spec = h.workload(
            self.workload_file,
            self.out,
            name=self.name,
            target=f"http://127.0.0.1:{self.port}",
            schedule={"kind": "poisson", "rate": rate},
            seed=1 + STEP_SEED * self.steps,
        )
        timing = ["--duration", str(self.args.duration), "--warmup", str(self.args.warmup)]
        document = h.bench(
            spec, result, "--rate", f"{rate:.0f}", "--name", self.policy, *timing, echo=False
        )
        self.drain()
        return document

    def search_step(self) -> bool:
        """The capacity search's next step; False once it has converged."""
        rate = self.search.next_rate()
        if rate is None:
            return False
        document = self.run(rate, self.out / f"{self.name}-step.json")
        step = Step.of(rate, document)
        self.search.record(step)
        verdict = "pass" if step.passes(self.search.slo_ms, self.search.min_achieved) else "fail"
        p99 = f"{step.p99_ms:,.1f}" if document["overall"]["p99_ms"] is not None else "-"
        print(
            f"{self.policy:22}{rate:>9,.0f}{step.achieved_rps:>10,.0f}{p99:>10}"
            f"{step.errors:>9,}  {verdict}",
            flush=True,
        )
        return True

    def drain(self, timeout_s: float = 30.0) -> None:
        """Until nothing is queued for the model or running (what an overloaded step left
        behind would take the next policy's CPU)."""
        url = f"http://127.0.0.1:{self.port}/v2/models/{self.model}/stats"
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            batching = h.get_json(url)["model_stats"][0]["batching"]
            if not batching["queued"] and not batching["busy_instances"]:
                return
            time.sleep(0.1)


def measure(
    model: str, policies: list[str], examples: Path, work: Path, out: Path, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Every policy's figures for one model, the policies taking turns (module doc)."""
    _, start_rps, max_rows = MODELS[model]
    runs = [Policy(model, p, examples, work, out, args) for p in policies]
    with contextlib.ExitStack() as stack:
        for run in runs:
            stack.enter_context(h.serving(h.worker(run.repo, run.port), run.port))
        print(f"\n=== {model}: capacity searches, one step each in turn ===", flush=True)
        print(f"{'policy':22}{'offered':>9}{'achieved':>10}{'p99 ms':>10}{'errors':>9}")
        searching = list(runs)
        while searching:
            searching = [run for run in searching if run.search_step()]
        capacity = {run.policy: run.search.capacity_rps for run in runs}
        reference = capacity.get("deadline")
        for policy, rps in capacity.items():
            print(f"{policy}: SLO capacity {f'{rps:,.0f} req/s' if rps else 'none'}")
        equal: dict[str, dict[str, Any]] = {}
        overload: dict[str, dict[str, Any]] = {}
        anchor = {run.policy: reference or capacity[run.policy] or start_rps for run in runs}
        for run in runs:  # (the same equal load for all, then each its own overload)
            equal[run.policy] = run.run(0.7 * anchor[run.policy], out / f"{run.name}.json")
        for run in runs:
            rate = min(3 * (capacity[run.policy] or anchor[run.policy]), args.max_rate)
            overload[run.policy] = run.run(rate, out / f"{run.name}-overload.json")
    results = {}
    for run in runs:
        served = equal[run.policy].get("server") or {}
        over = overload[run.policy]
        results[run.policy] = {
            "slo_ms": run.slo_ms,
            "capacity": capacity[run.policy],
            "equal_rps": 0.7 * anchor[run.policy],
            "equal": equal[run.policy]["overall"],
            "efficiency": (served.get("batch_size_mean") or 0.0) / max_rows,
            "overload_rps": over["overall"]["offered_rps"],
            "overload": over["overall"],
            "generator_behind": over["generator"]["behind"] or over["generator"]["cpu_bound"],
            "steps": [dataclasses.asdict(step) for step in run.search.steps],
        }
    return results


def report(model: str, results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{model}: SLO p99 <= {results['deadline']['slo_ms']:g} ms")
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
    parser.add_argument(
        "--max-rate",
        type=float,
        default=15000.0,
        help="the most one generator process is asked to offer",
    )
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "batching_policies")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tailserve-batching-"))
    examples = h.examples(work / "examples")
    summary = {}
    for model in args.models.split(","):
        policies = args.policies.split(",")
        results = measure(model, policies, examples, work, args.out, args)
        summary[model] = results
        if len(results) > 1:
            h.compare(
                [args.out / f"{model}-{p}.json" for p in results],
                args.out / f"{model}-compare.html",
            )
    print("\n\nSummary")
    for model, results in summary.items():
        report(model, results)
    (args.out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(f"\nresults and reports: {args.out}")


if __name__ == "__main__":
    main()
