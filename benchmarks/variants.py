"""Latency as a dial: each variant's SLO capacity and accuracy, and a load ramp to 3x the full
model's capacity served by the dial against the full model alone, side by side.

The stack is `tailserve up --workers 2` on the example repository (as `make run` starts it),
whose `sentiment` comes with variants (model.yaml's `variants`: the full model `fp32`, its
dynamic INT8 quantisation `int8`, a smaller model `small`). `churn` ships without: INT8 buys it
nothing (`tailserve optimize` keeps only fp32), so here its INT8 variant is made and kept by
`tailserve optimize --keep fp32,int8-dynamic` to measure that. Load: wrk2 (open loop, C),
unique inputs (churn rows; sentiment reviews of skewed lengths), 64 connections.

For each model (``--models``):

1. Each variant's SLO capacity (p99 within the model's SLO, no errors), pinned with the
   `X-Variant` header, and its accuracy as `tailserve optimize` measured it (model.yaml).
2. A ramp from 0.5x to 3x the full model's capacity in steps of ``--step-s`` measured seconds:
   once with every request pinned to `fp32` (the full model alone), once with the dial
   choosing. Per step: p50/p99, the goodput (200s within the SLO a second), and each variant's
   share of what the stack computed (its `tailserve_variant_requests` counters).
3. The top of the ramp again over 1,000 connections, both ways.

It prints the tables, writes them as JSON and draws the p99 and the variants' shares over the
ramp (`--out DIR`: ramp-MODEL.png, variants.json).

    python benchmarks/variants.py [--models sentiment,churn] [--seconds 10] [--step-s 10]
                                  [--capacity MODEL=RPS ...] [--out DIR]

Needs wrk2 on the PATH (see benchmarks/_wrk2.py). Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

import _wrk2
from _harness import examples, pyplot, up_stack, wait_served

RAMP = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
SCRIPTS = {"churn": _wrk2.SCRIPT, "sentiment": _wrk2.SENTIMENT}
START_RPS = {"churn": 3000.0, "sentiment": 100.0}
KEEP_CHURN = ("fp32", "int8-dynamic")


@dataclass
class Step:
    mode: str  # "fp32 alone" | "dial"
    factor: float
    rate: float
    connections: int
    p50_ms: float
    p99_ms: float
    goodput: float
    errors: int
    shares: dict[str, float]
    started_s: float  # since the ramp began


@dataclass
class ModelResult:
    model: str
    slo_ms: float
    accuracy: dict[str, float | None] = field(default_factory=dict)
    metric: str = ""
    capacity: dict[str, float] = field(default_factory=dict)
    ramp: list[Step] = field(default_factory=list)
    wide: list[Step] = field(default_factory=list)


def computed(url: str, model: str) -> dict[str, float]:
    """What the stack's workers computed for ``model``, by variant (the counters so far)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        page = reply.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name != "tailserve_variant_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == model:
                variant = sample.labels["variant"]
                counts[variant] = counts.get(variant, 0.0) + sample.value
    return counts


def _churn_probe() -> bytes:
    from tailserve.examples.churn import FIELDS, sample_rows

    row = sample_rows(1, seed=1)
    inputs = [
        {"name": f.name, "datatype": f.datatype, "shape": [1, 1], "data": row[f.name]}
        for f in FIELDS
    ]
    return orjson.dumps({"inputs": inputs})


PROBES = {
    "sentiment": b'{"inputs":[{"name":"token_ids","datatype":"INT64","shape":[1,3],'
    b'"data":[5,6,7]}]}',
    "churn": _churn_probe(),
}


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    done = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    total = sum(done.values())
    return {name: count / total for name, count in done.items()} if total else {}


def step(
    url: str, model: str, mode: str, factor: float, base: float, seconds: float, connections: int
) -> tuple[Step, float]:
    rate = base * factor
    pinned = "fp32" if mode == "fp32 alone" else ""
    before, began = computed(url, model), time.monotonic()
    run = _wrk2.run(
        url, rate, seconds, connections, script=SCRIPTS[model], variant=pinned, model=model
    )
    slo = SLO_MS[model]
    found = Step(
        mode,
        factor,
        rate,
        connections,
        run.quantile(0.50),
        run.quantile(0.99),
        run.goodput(slo),
        run.errors,
        shares(before, computed(url, model)),
        0.0,
    )
    return found, began


def print_step(found: Step) -> None:
    mix = ", ".join(f"{name} {share:.0%}" for name, share in sorted(found.shares.items()))
    print(
        f"  {found.mode:<11} {found.factor:3.1f}x {found.rate:7.0f} req/s "
        f"c={found.connections:<5} p50 {found.p50_ms:8.1f} p99 {found.p99_ms:8.1f} ms  "
        f"goodput {found.goodput:7.0f}/s  errors {found.errors:6d}  [{mix}]"
    )


SLO_MS: dict[str, float] = {}


def measure(url: str, repository: Path, model: str, args: argparse.Namespace) -> ModelResult:
    config = yaml.safe_load((repository / model / "model.yaml").read_text())
    slo = float(config.get("slo", {}).get("p99_ms", 50.0))
    SLO_MS[model] = slo
    variants = config.get("variants", {})
    result = ModelResult(model, slo, metric=variants.get("metric", ""))
    names = [choice["name"] for choice in variants.get("choices", [])]
    result.accuracy = {c["name"]: c.get("accuracy") for c in variants.get("choices", [])}
    print(f"\n== {model}: variants {names}, SLO p99 {slo:.0f} ms")
    wait_served(url, model, PROBES[model], {"X-Cache-Mode": "bypass"})
    given = dict(item.split("=", 1) for item in args.capacity)
    for name in names:
        if f"{model}.{name}" in given:
            result.capacity[name] = float(given[f"{model}.{name}"])
            continue
        print(f" SLO capacity of {name} alone:")
        result.capacity[name] = _wrk2.slo_capacity(
            url,
            args.seconds,
            slo,
            start_rps=START_RPS[model],
            script=SCRIPTS[model],
            variant=name,
            model=model,
        )
    for name in names:
        accuracy = result.accuracy.get(name)
        shown = f"{accuracy:.4f}" if accuracy is not None else "-"
        ratio = result.capacity[name] / result.capacity["fp32"] if result.capacity["fp32"] else 0
        print(
            f"  {name:<8} capacity {result.capacity[name]:7.0f} req/s ({ratio:4.2f}x fp32)  "
            f"{result.metric} {shown}"
        )
    base = result.capacity["fp32"]
    # A fresh stack's first seconds (workers still warming their caches of code and memory)
    # would fall in the first step: ~11 s of half the load first, not measured.
    _wrk2.run(url, base / 2, 1, 64, script=SCRIPTS[model], model=model)
    began = time.monotonic()
    for mode in ("fp32 alone", "dial"):
        print(f" ramp, {mode}:")
        for factor in RAMP:
            found, at = step(url, model, mode, factor, base, args.step_s, 64)
            found.started_s = at - began
            result.ramp.append(found)
            print_step(found)
    for mode in ("fp32 alone", "dial"):
        found, _ = step(url, model, mode, RAMP[-1], base, args.step_s, 1000)
        result.wide.append(found)
        print_step(found)
    alone = sum(s.goodput for s in result.ramp if s.mode == "fp32 alone")
    dial = sum(s.goodput for s in result.ramp if s.mode == "dial")
    print(f" goodput over the ramp, dial / fp32 alone: {dial / alone if alone else 0:.2f}x")
    if len(result.wide) == 2 and result.wide[0].goodput:
        print(
            f" goodput at 3x over 1,000 connections, dial / fp32 alone: "
            f"{result.wide[1].goodput / result.wide[0].goodput:.2f}x"
        )
    return result


def plot(result: ModelResult, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for mode, style in (("fp32 alone", "o--"), ("dial", "o-")):
        steps = [s for s in result.ramp if s.mode == mode]
        top.plot([s.factor for s in steps], [s.p99_ms for s in steps], style, label=mode)
    top.axhline(result.slo_ms, color="grey", linewidth=0.8, label="SLO")
    top.set_yscale("log")
    top.set_ylabel("p99 (ms)")
    top.legend()
    top.set_title(f"{result.model}: a ramp to 3x the full model's SLO capacity")
    dial = [s for s in result.ramp if s.mode == "dial"]
    names = sorted({name for s in dial for name in s.shares})
    bottom_stack = [0.0] * len(dial)
    for name in names:
        values = [s.shares.get(name, 0.0) for s in dial]
        bottom.bar([s.factor for s in dial], values, width=0.35, bottom=bottom_stack, label=name)
        bottom_stack = [a + b for a, b in zip(bottom_stack, values, strict=True)]
    bottom.set_ylabel("share computed (dial)")
    bottom.set_xlabel("offered load / full model's SLO capacity")
    bottom.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"  plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="sentiment,churn")
    parser.add_argument("--seconds", type=float, default=10.0, help="per capacity run")
    parser.add_argument("--step-s", type=float, default=10.0, help="per ramp step")
    parser.add_argument(
        "--capacity", action="append", default=[], help="MODEL.VARIANT=RPS: skip its search"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: list[ModelResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = examples(Path(tmp) / "repository")
        if "churn" in args.models.split(","):
            from tailserve.optimize import Options, optimize

            print("making churn's INT8 variant (tailserve optimize)")
            optimize(repository / "churn", Options(kinds=("dynamic",), keep=KEEP_CHURN))
        with up_stack(repository, "--workers", str(args.workers)) as url:
            for model in args.models.split(","):
                results.append(measure(url, repository, model, args))
    out = args.out or Path(tempfile.mkdtemp(prefix="tailserve-variants-"))
    out.mkdir(parents=True, exist_ok=True)
    for result in results:
        plot(result, out / f"ramp-{result.model}.png")
    document: list[dict[str, Any]] = [asdict(result) for result in results]
    (out / "variants.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    print(f"\nresults: {out / 'variants.json'}")


if __name__ == "__main__":
    main()
