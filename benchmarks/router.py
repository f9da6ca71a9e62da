"""The router's three questions side by side in one run, measured with `tailserve bench`.

1. **The tail.** Four workers of a model that spends ``--service-ms`` per batch off the CPU
   (as a GPU model would: four workers then fit on two cores), ``--tail-instances`` instances
   each (2: a request does not wait behind another's batch, which with one instance was most
   of a healthy replica's own p99.9); one of them is made slow at
   random (the test-only fault: 5% of its requests take 20 times as long). Round-robin, p2c,
   and p2c with hedging, each through its own router in front of the same workers, at the same
   offered rate: p50 / p99 / p99.9, and the extra copies hedging sent. Then the reference:
   the same load on four healthy workers (p2c), whose tail no policy can get below.
2. **Affinity.** ``churn`` with the in-process result cache on (L1 only, ``--l1-entries`` per
   worker) and Zipf(1.0) keys: the L1 hit ratio across four workers under ``affinity`` and
   under ``p2c``, and of one worker whose L1 is as large as the four together (the reference:
   affinity should come near it, p2c near a quarter-sized cache's). The workers restart
   between configurations, so each starts cold on the same request stream.
3. **The router's cost.** One ``churn`` worker (cache off), called directly and through the
   router (p2c, no hedging) at the same rate: the p50 the extra hop adds.

    python benchmarks/router.py [--parts tail,affinity,overhead] [--duration 30]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

import _harness as h

STEADY = """
import time

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.service_s = float(config.parameters["service_ms"]) / 1e3

    def predict(self, inputs):
        time.sleep(self.service_s)
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""


def steady_repository(root: Path, service_ms: float, instances: int = 1) -> Path:
    folder = root / "steady"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(STEADY)
    config = {
        "runtime": "python",
        "max_batch_size": 8,
        "instances": {"count": instances},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        "parameters": {"service_ms": service_ms},
        "warmup": {"batch_sizes": [1, 8]},
        "slo": {"p99_ms": 500},
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def spec(
    out: Path,
    name: str,
    model: str,
    target: str,
    rate: float,
    args: argparse.Namespace,
    **extra: Any,
) -> Path:
    document = {
        "name": name,
        "target": target,
        "protocol": "v2-json",
        "model": model,
        "keys": {"space": "unique"},
        "classes": [{"name": "single", "weight": 1, "rows": 1}],
        "schedule": {"kind": "poisson", "rate": rate},
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "slo": {"p99_ms": 500},
        **extra,
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@contextlib.contextmanager
def workers(
    repository: Path, count: int, slow: int | None = None, flags: Sequence[str] = ()
) -> Iterator[list[str]]:
    """``count`` workers (the ``slow``-th with the fault), all ready; yields their URLs."""
    with contextlib.ExitStack() as stack:
        ports = [h.free_port() for _ in range(count)]
        processes = []
        for i, port in enumerate(ports):
            fault = ["--fault-slow-fraction", "0.05", "--fault-slow-factor", "20"]
            command = h.worker(
                repository,
                port,
                "--grpc-port",
                str(h.free_port()),
                *flags,
                *(fault if i == slow else []),
            )
            process = subprocess.Popen(command, **h.QUIET)
            stack.callback(_stop, process)
            processes.append(process)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url, process in zip(urls, processes, strict=True):
            h.wait_ready(url, process)
        yield urls


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(timeout=60)


@contextlib.contextmanager
def router(backends: Sequence[str], *flags: str) -> Iterator[str]:
    port = h.free_port()
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
        *(f"--backend={url}" for url in backends),
        *flags,
    ]
    with h.serving(command, port) as url:
        yield url


def stats(result: dict[str, Any]) -> dict[str, Any]:
    overall: dict[str, Any] = result["overall"]
    return overall


# --- 1. the tail -----------------------------------------------------------------------------

# Ejection off in the three compared, so that each policy meets the slow replica on its own
# (latency ejection: a slow reply of a 20 ms model would eject the replica at once, whatever
# the policy; limping ejection would take out the replica whose requests keep losing to
# hedges); the last row is the router's default configuration, ejection included.
NO_EJECT = ["--eject-latency-factor", "0", "--eject-overtaken-share", "0"]
TAIL_CONFIGS = {
    "round-robin": ["--balance", "round-robin", "--no-hedge", *NO_EJECT],
    "p2c": ["--balance", "p2c", "--no-hedge", *NO_EJECT],
    "p2c+hedging": ["--balance", "p2c", *NO_EJECT],
    "default": [],
}


def tail(work: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    repository = steady_repository(work / "steady-repo", args.service_ms, args.tail_instances)
    results: dict[str, Any] = {}
    with workers(repository, 4, slow=3) as urls:
        for name, flags in TAIL_CONFIGS.items():
            print(f"\n=== tail: {name} ===", flush=True)
            with router(urls, *flags) as target:
                path = spec(out, f"tail-{name}", "steady", target, args.tail_rate, args)
                result = h.bench(path, out / f"tail-{name}.json", "--name", name)
                state = h.get_json(f"{target}/router/backends")
                ejected = ejections(target)
            hedges = state["hedges"]
            results[name] = {
                **{k: stats(result)[k] for k in ("p50_ms", "p99_ms", "p999_ms", "errors")},
                "achieved_rps": stats(result)["achieved_rps"],
                "hedges_sent": hedges["sent"],
                "requests": hedges["requests"],
                "extra": hedges["sent"] / max(1, hedges["requests"]),
                # Hedges that came due with the budget empty, and those sent once a token came.
                "refused": hedges["refused"],
                "late": hedges.get("late", 0),
                # Sent at their delay though rationed: their replica kept losing to hedges.
                "suspect": hedges.get("suspect", 0),
                "hedge_delay_ms": (hedges.get("delays_ms") or {}).get("steady/s"),
                "ejections": ejected,
            }
    # The reference: the same load with no replica slow (p2c, hedging off): the tail the
    # healthy replicas have on their own, the least any policy can bring the p99.9 down to.
    print("\n=== tail: healthy (no replica slow, p2c) ===", flush=True)
    with workers(repository, 4) as urls, router(urls, *TAIL_CONFIGS["p2c"]) as target:
        path = spec(out, "tail-healthy", "steady", target, args.tail_rate, args)
        result = h.bench(path, out / "tail-healthy.json", "--name", "healthy")
    results["healthy"] = {k: stats(result)[k] for k in ("p50_ms", "p99_ms", "p999_ms", "errors")}
    h.compare([out / f"tail-{n}.json" for n in TAIL_CONFIGS], out / "tail-compare.html")
    return results


def ejections(target: str) -> dict[str, int]:
    """The router's outlier ejections so far, by reason."""
    with urllib.request.urlopen(f"{target}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tailserve_router_ejections":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    reason = sample.labels["reason"]
                    counts[reason] = counts.get(reason, 0) + int(sample.value)
    return counts


def print_tail(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n1. Tail: 4 workers, {args.service_ms:g} ms per batch, {args.tail_instances} "
        f"instance(s) each, one slow (5% x 20); {args.tail_rate:g} req/s offered"
    )
    head = (
        f"{'policy':14}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'errors':>8}{'extra':>8}"
        f"{'no token':>10}{'late':>6}{'suspect':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        if name == "healthy":
            continue
        hedging = name in ("p2c+hedging", "default")
        extra = f"{r['extra']:.1%}" if hedging else "-"
        refused, late, suspect = (
            (str(r.get(k, "-")) for k in ("refused", "late", "suspect"))
            if hedging
            else ("-", "-", "-")
        )
        print(
            f"{name:14}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['p999_ms']:>10.2f}"
            f"{r['errors']:>8}{extra:>8}{refused:>10}{late:>6}{suspect:>9}"
        )
    for name, r in results.items():
        if r.get("ejections"):
            reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(r["ejections"].items()))
            print(f"{name}: ejections {reasons}")
    base, hedged = results.get("round-robin"), results.get("p2c+hedging")
    default = results.get("default")
    if base and default and default["p999_ms"]:
        print(
            f"p99.9 round-robin / default (hedging and ejection): "
            f"{base['p999_ms'] / default['p999_ms']:.1f}x"
        )
    if base and hedged and hedged["p999_ms"]:
        print(f"p99.9 round-robin / p2c+hedging: {base['p999_ms'] / hedged['p999_ms']:.1f}x")
    p2c = results.get("p2c")
    if p2c and hedged and hedged["p999_ms"]:
        print(f"p99.9 p2c / p2c+hedging: {p2c['p999_ms'] / hedged['p999_ms']:.1f}x")
    delay = hedged.get("hedge_delay_ms") if hedged else None
    if base and hedged and delay:
        # A slow reply is hedged only after the delay, and the copy then takes a normal
        # reply's time: no hedge after the p95 answers sooner than their sum.
        floor = delay + hedged["p50_ms"]
        print(
            f"hedge delay (the recent p95) {delay:.2f} ms + p50 {hedged['p50_ms']:.2f} ms = "
            f"{floor:.2f} ms, the least a hedged slow request can take: while over 0.1% of "
            f"requests meet a slow reply, the most p99.9 can drop is round-robin / that = "
            f"{base['p999_ms'] / floor:.1f}x (below it only where p2c keeps them off the "
            "slow replica)"
        )
    healthy = results.get("healthy")
    if base and healthy and healthy["p999_ms"]:
        best = base["p999_ms"] / healthy["p999_ms"]
        print(
            f"healthy reference (no replica slow, p2c): p50 {healthy['p50_ms']:.2f} ms, p99 "
            f"{healthy['p99_ms']:.2f} ms, p99.9 {healthy['p999_ms']:.2f} ms: no policy gets "
            f"below the healthy replicas' own tail, so round-robin / that = {best:.1f}x is "
            "the most any can achieve"
        )


# --- 2. affinity -----------------------------------------------------------------------------


def affinity(examples: Path, work: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    entries = args.l1_entries
    results: dict[str, Any] = {}
    configs = {
        "affinity": (4, entries, ["--balance", "affinity", "--no-hedge"]),
        "p2c": (4, entries, ["--balance", "p2c", "--no-hedge"]),
        "one-worker-4x-L1": (1, 4 * entries, None),
    }
    keys = {"space": "zipf", "size": args.keyspace, "s": 1.0}
    fields = {"monthly_spend": {"lognormal": [4.2, 0.7], "clip": [0, 5000]}}
    for name, (count, size, flags) in configs.items():
        cache = {"enabled": True, "ttl_s": 600, "l1": {"max_entries": size, "policy": "tinylfu"}}
        repository = h.one_model(examples / "churn", work / f"affinity-{name}", cache=cache)
        print(f"\n=== affinity: {name} ===", flush=True)
        with workers(repository, count) as urls, contextlib.ExitStack() as stack:
            target = urls[0] if flags is None else stack.enter_context(router(urls, *flags))
            path = spec(
                out,
                f"affinity-{name}",
                "churn",
                target,
                args.affinity_rate,
                args,
                keys=keys,
                fields=fields,
            )
            result = h.bench(path, out / f"affinity-{name}.json", "--name", name)
        tiers = (result.get("server") or {}).get("cache") or {}
        total = max(1, sum(tiers.values()))
        results[name] = {
            "l1_hit": tiers.get("l1", 0) / total,
            "p99_ms": stats(result)["p99_ms"],
            "errors": stats(result)["errors"],
        }
    return results


def print_affinity(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n2. Affinity: churn, Zipf(1.0) over {args.keyspace:,} keys, L1 "
        f"{args.l1_entries:,} entries per worker; {args.affinity_rate:g} req/s"
    )
    head = f"{'config':18}{'L1 hit':>8}{'p99 ms':>9}{'errors':>8}"
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        print(f"{name:18}{r['l1_hit']:>8.1%}{r['p99_ms']:>9.2f}{r['errors']:>8}")


# --- 3. the router's cost --------------------------------------------------------------------


def overhead(examples: Path, work: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    repository = h.one_model(examples / "churn", work / "overhead", cache={})
    results: dict[str, Any] = {}
    with workers(repository, 1) as urls, router(urls, "--no-hedge") as routed:
        for name, target in (("direct", urls[0]), ("via-router", routed)):
            print(f"\n=== overhead: {name} ===", flush=True)
            path = spec(
                out,
                f"overhead-{name}",
                "churn",
                target,
                args.overhead_rate,
                args,
                fields={"monthly_spend": {"lognormal": [4.2, 0.7], "clip": [0, 5000]}},
            )
            result = h.bench(path, out / f"overhead-{name}.json", "--name", name)
            results[name] = {k: stats(result)[k] for k in ("p50_ms", "p99_ms", "errors")}
    return results


def print_overhead(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n3. The router's cost: one churn worker, {args.overhead_rate:g} req/s")
    head = f"{'path':14}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}"
    print(head + "\n" + "-" * len(head))
    for name, r in results.items():
        print(f"{name:14}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.2f}{r['errors']:>8}")
    if "direct" in results and "via-router" in results:
        added = results["via-router"]["p50_ms"] - results["direct"]["p50_ms"]
        print(f"p50 added by the router: {added * 1e3:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="tail,affinity,overhead")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds a run")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--service-ms", type=float, default=5.0)
    parser.add_argument("--tail-rate", type=float, default=200.0)
    parser.add_argument("--tail-instances", type=int, default=2)
    parser.add_argument("--affinity-rate", type=float, default=400.0)
    parser.add_argument("--keyspace", type=int, default=20_000)
    parser.add_argument("--l1-entries", type=int, default=1_000)
    parser.add_argument("--overhead-rate", type=float, default=200.0)
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "router")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tailserve-router-"))
    parts = args.parts.split(",")
    examples = h.examples(work / "examples") if {"affinity", "overhead"} & set(parts) else None
    summary: dict[str, Any] = {}
    if "tail" in parts:
        summary["tail"] = tail(work, args.out, args)
    if "affinity" in parts and examples is not None:
        summary["affinity"] = affinity(examples, work, args.out, args)
    if "overhead" in parts and examples is not None:
        summary["overhead"] = overhead(examples, work, args.out, args)
    print("\n\nSummary")
    if "tail" in summary:
        print_tail(summary["tail"], args)
    if "affinity" in summary:
        print_affinity(summary["affinity"], args)
    if "overhead" in summary:
        print_overhead(summary["overhead"], args)
    (args.out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(f"\nresults and reports: {args.out}")


if __name__ == "__main__":
    main()
