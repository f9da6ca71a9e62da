"""A pipeline within its budget: the funnel's p99 against its SLO as load rises to 3x its SLO
capacity, and how often each step degrades, against the same funnel with no budgets.

The stack is `tailserve up --workers 2 --redis-url URL` on the example repository (as `make run`
starts it), with a private Redis holding the ranker's features and the retrieval vectors. Its
`funnel` is a pipeline (retrieve 400 candidates, look up their features, rank them, keep the
top 50, re-rank), each step within its budget and degrading as declared when it would run late
(fewer rows, a cheaper variant, a fallback). Beside it the benchmark adds `funnel_nobudget`:
the same steps with `budgets: false` (no step has a budget of its own, none degrades: a plain
chain of calls up to the request's deadline). Load: wrk2 (open loop, C), one user a request,
drawn uniformly from the 100,000 (`_wrk2.FUNNEL`), 64 connections.

1. The funnel's SLO capacity (p99 within its 50 ms, no errors), with budgets.
2. A ramp from 0.5x to 3x that capacity in steps of ``--step-s`` measured seconds, `funnel` and
   `funnel_nobudget` in turn at each step. Per step: p50/p99/p99.9, the goodput (200s within
   the SLO a second), the errors, the share of 200s that came degraded (an `x-degraded`
   header), each step's degradations by kind a request (the workers'
   `tailserve_pipeline_degradations_total`), each step's p99
   (`tailserve_pipeline_stage_seconds`) and the workers' event loop lag p99 (a step cut off at
   its budget still overruns it by the loop's lag). The workers' figures cover the whole wrk2
   run, its calibration (10 s at the same rate) included; wrk2's cover the measured window.
3. The top of the ramp again over 1,000 connections, both pipelines.

It prints the tables and the ratios (budgets / no budgets: p99, goodput), writes them as JSON
and draws the p99 of both and the degradation rates over the ramp (`--out DIR`: funnel.png,
funnel.json; default a temporary folder, printed).

    python benchmarks/funnel.py [--seconds 10] [--step-s 10] [--capacity RPS] [--workers 2]
                                [--out DIR]

Needs wrk2 on the PATH (see benchmarks/_wrk2.py) and redis-server. Every wrk2 run calibrates
for 10 s first: the search is a dozen or so runs of 10 + ``--seconds`` s, the rest 16 runs of
10-13 + ``--step-s`` s (about 10 minutes in all at the defaults). Check with `ps` that nothing
else runs: on a busy machine the steps overrun their budgets by the CPU they wait for.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

import _wrk2
from _harness import examples, histogram_quantile, pyplot, redis, up_stack, wait_served

RAMP = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
BUDGETS, NO_BUDGETS = "funnel", "funnel_nobudget"
PIPELINES = (BUDGETS, NO_BUDGETS)
START_RPS = 50.0
PROBE = b'{"inputs":[{"name":"user_id","datatype":"INT64","shape":[1],"data":[42]}]}'

Buckets = dict[float, float]


@dataclass
class Step:
    pipeline: str
    factor: float
    rate: float
    connections: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    goodput: float
    ok: int
    errors: int
    degraded_share: float  # of the 200s, those with an x-degraded header
    # "stage:how" -> degradations a pipeline run (the workers' counters over the run)
    degradations: dict[str, float]
    stage_p99_ms: dict[str, float]
    loop_lag_p99_ms: float  # the workers' event loops (tailserve_event_loop_lag_seconds)
    runs: int  # pipeline runs the workers counted over the run (calibration included)
    started_s: float  # since the ramp began


@dataclass
class Result:
    slo_ms: float
    capacity: float
    workers: int
    stages: list[str]
    ramp: list[Step] = field(default_factory=list)
    wide: list[Step] = field(default_factory=list)


@dataclass
class Scrape:
    """The workers' pipeline metrics at one moment, summed over the workers."""

    stages: dict[tuple[str, str], Buckets] = field(default_factory=dict)
    degradations: dict[tuple[str, str, str], float] = field(default_factory=dict)
    loop_lag: Buckets = field(default_factory=dict)


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        page = reply.read().decode()
    found = Scrape()
    for family in text_string_to_metric_families(page):
        if family.name == "tailserve_pipeline_stage_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    key = (sample.labels["pipeline"], sample.labels["stage"])
                    buckets = found.stages.setdefault(key, {})
                    upper = float(sample.labels["le"])
                    buckets[upper] = buckets.get(upper, 0.0) + sample.value
        elif family.name == "tailserve_event_loop_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    upper = float(sample.labels["le"])
                    found.loop_lag[upper] = found.loop_lag.get(upper, 0.0) + sample.value
        elif family.name == "tailserve_pipeline_degradations":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    labels = sample.labels
                    how = (labels["pipeline"], labels["stage"], labels["how"])
                    found.degradations[how] = found.degradations.get(how, 0.0) + sample.value
    return found


def between(
    before: Scrape, after: Scrape, pipeline: str, stages: list[str]
) -> tuple[int, dict[str, float], dict[str, float]]:
    """Over the span between two scrapes, for ``pipeline``: its runs, each "stage:how"'s
    degradations a run, and each stage's p99 (ms)."""
    inf = float("inf")
    first = (pipeline, stages[0])
    runs = after.stages.get(first, {}).get(inf, 0.0) - before.stages.get(first, {}).get(inf, 0.0)
    rates: dict[str, float] = {}
    for key, count in after.degradations.items():
        if key[0] != pipeline:
            continue
        done = count - before.degradations.get(key, 0.0)
        if done > 0:
            rates[f"{key[1]}:{key[2]}"] = done / runs if runs else math.nan
    p99 = {
        stage: histogram_quantile(
            before.stages.get((pipeline, stage), {}), after.stages.get((pipeline, stage), {}), 0.99
        )
        * 1e3
        for stage in stages
        if (pipeline, stage) in after.stages
    }
    return int(runs), rates, p99


def add_unbudgeted(repository: Path) -> None:
    """``funnel_nobudget``: the funnel's steps with ``budgets: false``."""
    from tailserve.examples.churn import write_config
    from tailserve.examples.funnel import pipeline_config

    folder = repository / NO_BUDGETS
    write_config(folder, pipeline_config(budgets=False))
    (folder / "1").mkdir(exist_ok=True)


def step(
    url: str, pipeline: str, factor: float, result: Result, seconds: float, connections: int
) -> Step:
    rate = result.capacity * factor
    before = scrape(url)
    run = _wrk2.run(url, rate, seconds, connections, script=_wrk2.FUNNEL, model=pipeline)
    after = scrape(url)
    runs, rates, stage_p99 = between(before, after, pipeline, result.stages)
    lag = histogram_quantile(before.loop_lag, after.loop_lag, 0.99) * 1e3
    return Step(
        pipeline,
        factor,
        rate,
        connections,
        run.quantile(0.50),
        run.quantile(0.99),
        run.quantile(0.999),
        run.goodput(result.slo_ms),
        run.ok,
        run.errors,
        run.degraded / run.ok if run.ok else 0.0,
        rates,
        stage_p99,
        lag,
        runs,
        0.0,
    )


def print_step(found: Step) -> None:
    fired = ", ".join(f"{name} {rate:.1%}" for name, rate in sorted(found.degradations.items()))
    stages = " ".join(f"{name} {ms:.1f}" for name, ms in found.stage_p99_ms.items())
    print(
        f"  {found.pipeline:<15} {found.factor:3.1f}x {found.rate:6.0f} req/s "
        f"c={found.connections:<4} p50 {found.p50_ms:7.1f} p99 {found.p99_ms:7.1f} "
        f"p99.9 {found.p999_ms:7.1f} ms  goodput {found.goodput:6.0f}/s  "
        f"errors {found.errors:5d}  degraded {found.degraded_share:5.1%}"
    )
    print(f"  {'':<15} stage p99 ms: {stages}; event loop lag p99 {found.loop_lag_p99_ms:.1f}")
    if fired:
        print(f"  {'':<15} degradations a request: {fired}")


def ratio(a: float, b: float) -> str:
    return f"{a / b:6.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "     -"


def print_ratios(result: Result) -> None:
    print("\n budgets / no budgets:")
    print(f"  {'load':>5} {'c':>5} {'p99':>8} {'goodput':>8}")
    rows = [*result.ramp, *result.wide]
    for found in rows:
        if found.pipeline != BUDGETS:
            continue
        other = next(
            (
                s
                for s in rows
                if s.pipeline == NO_BUDGETS
                and s.factor == found.factor
                and s.connections == found.connections
            ),
            None,
        )
        if other is None:
            continue
        print(
            f"  {found.factor:4.1f}x {found.connections:5d} "
            f"{ratio(found.p99_ms, other.p99_ms):>8} {ratio(found.goodput, other.goodput):>8}"
        )
    budgeted = sum(s.goodput for s in result.ramp if s.pipeline == BUDGETS)
    plain = sum(s.goodput for s in result.ramp if s.pipeline == NO_BUDGETS)
    print(f"  goodput over the ramp: {ratio(budgeted, plain).strip()}")


def measure(url: str, args: argparse.Namespace, result: Result) -> None:
    print(f"\n== funnel: SLO p99 {result.slo_ms:.0f} ms, stages {result.stages}")
    for pipeline in PIPELINES:
        wait_served(url, pipeline, PROBE, timeout_s=120.0)
    if not result.capacity:
        print(" SLO capacity of the funnel, with budgets:")
        result.capacity = _wrk2.slo_capacity(
            url,
            args.seconds,
            result.slo_ms,
            start_rps=START_RPS,
            script=_wrk2.FUNNEL,
            model=BUDGETS,
        )
        if not result.capacity:
            raise SystemExit("the funnel meets its SLO at no rate tried")
    print(f"  capacity {result.capacity:.0f} req/s")
    # A fresh stack's first seconds (workers warming their caches of code and memory, the
    # index read) would fall in the first step: ~11 s of half the load each first, unmeasured.
    for pipeline in PIPELINES:
        _wrk2.run(url, result.capacity / 2, 1, 64, script=_wrk2.FUNNEL, model=pipeline)
    began = time.monotonic()
    print(" ramp:")
    for factor in RAMP:
        for pipeline in PIPELINES:
            at = time.monotonic() - began
            found = step(url, pipeline, factor, result, args.step_s, 64)
            found.started_s = at
            result.ramp.append(found)
            print_step(found)
    print(" the top of the ramp over 1,000 connections:")
    for pipeline in PIPELINES:
        found = step(url, pipeline, RAMP[-1], result, args.step_s, 1000)
        result.wide.append(found)
        print_step(found)
    print_ratios(result)


def plot(result: Result, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for pipeline, style, label in ((NO_BUDGETS, "o--", "no budgets"), (BUDGETS, "o-", "budgets")):
        steps = [s for s in result.ramp if s.pipeline == pipeline]
        top.plot([s.factor for s in steps], [s.p99_ms for s in steps], style, label=label)
    top.axhline(result.slo_ms, color="grey", linewidth=0.8, label=f"SLO {result.slo_ms:.0f} ms")
    top.set_yscale("log")
    top.set_ylabel("p99 (ms)")
    top.legend()
    top.set_title(f"funnel: a ramp to 3x its SLO capacity ({result.capacity:.0f} req/s)")
    budgeted = [s for s in result.ramp if s.pipeline == BUDGETS]
    factors = [s.factor for s in budgeted]
    for name in sorted({name for s in budgeted for name in s.degradations}):
        values = [s.degradations.get(name, 0.0) for s in budgeted]
        bottom.plot(factors, values, "o-", label=name)
    shares = [s.degraded_share for s in budgeted]
    bottom.plot(factors, shares, "k:", label="any (share of 200s)")
    bottom.set_ylabel("degradations a request (budgets)")
    bottom.set_xlabel("offered load / the funnel's SLO capacity")
    bottom.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"  plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per capacity run")
    parser.add_argument("--step-s", type=float, default=10.0, help="per ramp step")
    parser.add_argument("--capacity", type=float, default=0.0, help="RPS: skip the search")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tailserve.examples.funnel import pipeline_config

    config = pipeline_config()
    stages = [s["name"] for s in config["pipeline"]["steps"]]
    result = Result(float(config["slo"]["p99_ms"]), args.capacity, args.workers, stages)
    with tempfile.TemporaryDirectory() as tmp, redis(Path(tmp)) as redis_url:
        print(f"writing the examples and loading their features into {redis_url}")
        repository = examples(Path(tmp) / "repository", "--redis-url", redis_url)
        add_unbudgeted(repository)
        flags = ("--workers", str(args.workers), "--redis-url", redis_url)
        with up_stack(repository, *flags) as url:
            measure(url, args, result)
    out = args.out or Path(tempfile.mkdtemp(prefix="tailserve-funnel-"))
    out.mkdir(parents=True, exist_ok=True)
    plot(result, out / "funnel.png")
    document = orjson.dumps(asdict(result), option=orjson.OPT_INDENT_2)
    (out / "funnel.json").write_bytes(document)
    print(f"\nresults: {out / 'funnel.json'}")


if __name__ == "__main__":
    main()
