"""Many models on a worker: 20 models on a worker whose memory budget holds 5, Zipf traffic over
them, side by side with a worker that holds all 20.

The models are 20 copies of the churn example (ONNX, `tailserve examples`), each padded with a
``--pad-mb`` initializer that its graph reads (a Gather at an index computed from the request's
input, which no optimiser can fold away), so that each costs a real, measurable amount of
memory; their result caches are off (the inputs are unique).

1. The worker "all 20": no budget, every model loads at start. Its metrics give what each model
   was measured to cost (`tailserve_model_memory_bytes`); the budget is the five largest costs
   plus half the median, which holds five models and not six.
2. The worker "budget of 5": `--model-memory-mb` that budget. Five load at start, the others
   when a request needs them, the least recently used unloading to make room (the default,
   `--model-eviction lru`).
3. The worker "budget, traffic": the same budget, the model with the least recent traffic
   unloading instead (`--model-eviction traffic`).

Each worker gets the same open-loop load from wrk2 (C), one run a rate of ``--rates`` over 64
connections: churn rows with unique inputs, each request for the model of rank k with
probability proportional to 1/k^s (Zipf, ``--zipf``), with ``X-Deadline-Ms: --deadline-ms``
(how long a client lets a request for a cold model wait for its load). It prints, per rate,
each worker's p50/p99/p99.9, its goodput (200s within churn's 50 ms SLO a second), its 503s,
the share of requests that waited for a load and that were refused one (the worker's
`tailserve_cold_requests_total` over its `tailserve_requests_total`), the loads a second and
their mean time, and the worker's resident memory; and the budget's figure over all 20's.

    python benchmarks/many_models.py [--rates 25,100] [--seconds 20] [--zipf 1.0]
                                     [--deadline-ms 1000] [--pad-mb 32] [--json FILE]

Needs wrk2 on the PATH (see benchmarks/_wrk2.py). Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import orjson
import yaml
from onnx import helper, numpy_helper
from prometheus_client.parser import text_string_to_metric_families

import _wrk2
from _harness import examples, free_port, server_process, worker

MODELS = 20
HOLDS = 5
SLO_MS = 50.0
CONNECTIONS = 64


# --- the models ------------------------------------------------------------------------------


def padded(model: onnx.ModelProto, pad_mb: int) -> onnx.ModelProto:
    """churn with ``pad_mb`` MiB of float32 it reads: churn_probability + 0 * pad[min(tenure)*0]."""
    graph = model.graph
    (last,) = [node for node in graph.node if "churn_probability" in node.output]
    last.output[:] = ["churn_probability_raw"]
    pad = np.zeros(pad_mb * 2**20 // 4, dtype=np.float32)
    graph.initializer.extend(
        [
            numpy_helper.from_array(pad, "pad"),
            numpy_helper.from_array(np.array(0, dtype=np.int64), "pad_zero_i"),
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "pad_zero_f"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("ReduceMin", ["tenure_months"], ["pad_min"], keepdims=0),
            helper.make_node("Mul", ["pad_min", "pad_zero_i"], ["pad_index"]),
            helper.make_node("Gather", ["pad", "pad_index"], ["pad_value"]),
            helper.make_node("Mul", ["pad_value", "pad_zero_f"], ["pad_nothing"]),
            helper.make_node(
                "Add", ["churn_probability_raw", "pad_nothing"], ["churn_probability"]
            ),
        ]
    )
    onnx.checker.check_model(model)
    return model


def repository(root: Path, pad_mb: int) -> Path:
    """``MODELS`` padded copies of churn, churn00..churn19, without a result cache."""
    source = examples(root / "examples") / "churn"
    model = padded(onnx.load(str(source / "1" / "model.onnx")), pad_mb)
    config = yaml.safe_load((source / "model.yaml").read_text())
    config.pop("cache", None)
    out = root / "repository"
    for index in range(MODELS):
        folder = out / f"churn{index:02d}"
        (folder / "1").mkdir(parents=True)
        onnx.save(model, str(folder / "1" / "model.onnx"))
        (folder / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.rmtree(root / "examples")
    return out


# --- the load --------------------------------------------------------------------------------


def zipf_script(zipf: float, deadline_ms: float) -> str:
    """wrk2's workload: unique churn rows, the model drawn by Zipf over churn00..churn19."""
    weights = [1 / (rank**zipf) for rank in range(1, MODELS + 1)]
    cumulative = np.cumsum(weights) / sum(weights)
    cdf = ", ".join(f"{p:.6f}" for p in cumulative[:-1]) + ", 1.0"
    workload = (
        _wrk2.CHURN_BODY
        + r"""
local cdf = {{CDF}}
headers["X-Deadline-Ms"] = "{DEADLINE}"

function request()
  local u, rank = math.random(), 1
  while cdf[rank] < u do rank = rank + 1 end
  local target = string.format("/v2/models/churn%02d/infer", rank - 1)
  return wrk.format("POST", target, headers, churn_body())
end
"""
    )
    return _wrk2._script(
        workload.replace("{CDF}", cdf).replace("{DEADLINE}", str(round(deadline_ms)))
    )


# --- what the worker says --------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """The worker's counters and gauges that matter here, summed over their labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        page = reply.read().decode()
    wanted = {
        "tailserve_requests_total": "requests",
        "tailserve_model_load_seconds_count": "loads",
        "tailserve_model_load_seconds_sum": "load_s",
        "tailserve_models_loaded": "loaded",
    }
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if sample.name == "tailserve_cold_requests_total":
                key = f"cold_{sample.labels['outcome']}"
            if key is not None:
                out[key] = out.get(key, 0.0) + sample.value
    return out


def costs(url: str) -> list[int]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        page = reply.read().decode()
    return [
        int(sample.value)
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "tailserve_model_memory_bytes"
    ]


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Result:
    worker: str
    rate: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    goodput: float  # 200s within the SLO a second
    unavailable: float  # 503s, a share of the answers in the window
    waited: float  # requests that waited for a load, a share of all the worker answered
    refused_for_load: float  # requests refused because the load would end past the deadline
    late: float  # requests whose load outlasted their deadline
    loads_per_s: float
    mean_load_ms: float
    models_loaded: float
    resident_mib: float


@contextlib.contextmanager
def started(repository_dir: Path, *flags: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    command = worker(repository_dir, port, "--grpc-port", "0", "--jobs-concurrency", "0", *flags)
    with server_process(command, port) as (url, process):
        yield url, process.pid


def measure(
    name: str, url: str, pid: int, rates: list[float], args: argparse.Namespace
) -> list[Result]:
    script = zipf_script(args.zipf, args.deadline_ms)
    results = []
    for rate in rates:
        before, began = scrape(url), time.monotonic()
        run = _wrk2.run(url, rate, args.seconds, CONNECTIONS, script=script)
        after, took = scrape(url), time.monotonic() - began
        done = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
        answered = max(1.0, done.get("requests", 0.0))
        loads = done.get("loads", 0.0)
        result = Result(
            worker=name,
            rate=rate,
            p50_ms=run.quantile(0.50),
            p99_ms=run.quantile(0.99),
            p999_ms=run.quantile(0.999),
            goodput=run.goodput(SLO_MS),
            unavailable=run.unavailable / max(1, run.answered),
            waited=done.get("cold_waited", 0.0) / answered,
            refused_for_load=done.get("cold_refused", 0.0) / answered,
            late=done.get("cold_late", 0.0) / answered,
            loads_per_s=loads / took,
            mean_load_ms=1e3 * done.get("load_s", 0.0) / loads if loads else 0.0,
            models_loaded=after.get("loaded", 0.0),
            resident_mib=resident_mib(pid),
        )
        results.append(result)
        print(
            f"  {name}, {rate:.0f} req/s: p99 {result.p99_ms:.1f} ms, waited "
            f"{result.waited:.1%}, loads {result.loads_per_s:.1f}/s",
            flush=True,
        )
    return results


def table(results: list[Result], rates: list[float]) -> str:
    rows = [
        ("p50 ms", "p50_ms", "{:.2f}"),
        ("p99 ms", "p99_ms", "{:.2f}"),
        ("p99.9 ms", "p999_ms", "{:.2f}"),
        (f"goodput (200s within {SLO_MS:.0f} ms)/s", "goodput", "{:,.0f}"),
        ("503s, share of answers", "unavailable", "{:.2%}"),
        ("waited for a load", "waited", "{:.2%}"),
        ("refused: the load would miss the deadline", "refused_for_load", "{:.2%}"),
        ("load outlasted the deadline", "late", "{:.2%}"),
        ("loads a second", "loads_per_s", "{:.1f}"),
        ("mean load ms", "mean_load_ms", "{:.0f}"),
        ("models loaded at the end", "models_loaded", "{:.0f}"),
        ("worker resident MiB", "resident_mib", "{:,.0f}"),
    ]
    by = {(r.worker, r.rate): r for r in results}
    lines = []
    for rate in rates:
        full, budget = by[("all 20", rate)], by[("budget of 5", rate)]
        other = by.get(("budget, traffic", rate))
        lines.append(f"\n{rate:,.0f} req/s")
        header = f"  {'':44} {'all 20':>12} {'budget of 5':>12} {'ratio':>7}"
        lines.append(header + (f" {'by traffic':>12} {'ratio':>7}" if other else ""))
        for label, key, form in rows:
            a, b = getattr(full, key), getattr(budget, key)
            ratio = f"{b / a:.2f}x" if a else "-"
            line = f"  {label:44} {form.format(a):>12} {form.format(b):>12} {ratio:>7}"
            if other is not None:
                c = getattr(other, key)
                line += f" {form.format(c):>12} {f'{c / a:.2f}x' if a else '-':>7}"
            lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="25,100", help="req/s, one run each (25,100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds a run")
    parser.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent (1.0)")
    parser.add_argument("--deadline-ms", type=float, default=1000.0, help="X-Deadline-Ms")
    parser.add_argument("--pad-mb", type=int, default=32, help="MiB each model is padded with")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    _wrk2.binary()  # (fails early, naming what is missing)
    with tempfile.TemporaryDirectory(prefix="many-models-") as tmp:
        print(f"writing {MODELS} copies of churn padded with {args.pad_mb} MiB each ...")
        repo = repository(Path(tmp), args.pad_mb)
        results: list[Result] = []
        with started(repo) as (url, pid):
            measured = sorted(costs(url))
            print(
                f"all 20 loaded: each model measured at {measured[0] / 2**20:.1f}-"
                f"{measured[-1] / 2**20:.1f} MiB; the worker holds {resident_mib(pid):,.0f} MiB"
            )
            results += measure("all 20", url, pid, rates, args)
        budget_mb = (sum(measured[-HOLDS:]) + statistics.median(measured) / 2) / 2**20
        print(f"budget of {HOLDS}: --model-memory-mb {budget_mb:.1f}")
        with started(repo, "--model-memory-mb", f"{budget_mb:.1f}") as (url, pid):
            results += measure("budget of 5", url, pid, rates, args)
        traffic = ("--model-memory-mb", f"{budget_mb:.1f}", "--model-eviction", "traffic")
        with started(repo, *traffic) as (url, pid):
            results += measure("budget, traffic", url, pid, rates, args)
    print(
        f"\n{MODELS} models of {args.pad_mb} MiB padding, Zipf s={args.zipf}, "
        f"X-Deadline-Ms {args.deadline_ms:.0f}, {CONNECTIONS} connections, "
        f"{args.seconds:.0f} s measured a run"
    )
    print(table(results, rates))
    if args.json is not None:
        args.json.write_bytes(
            orjson.dumps([asdict(r) for r in results], option=orjson.OPT_INDENT_2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
