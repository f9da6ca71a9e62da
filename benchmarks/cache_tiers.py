"""Result cache tiers side by side in one run, measured with `tailserve bench`.

Configurations, each in its own worker against one private redis-server (emptied between
them): no cache; Redis only (every lookup a round trip, with the standard client redis-py);
the same through tailserve's lean pipelined connection; L1 LRU + Redis; L1 W-TinyLFU + Redis
(both on the lean connection). And, for ``churn``, Redis only as the tutorials build it: the
naive FastAPI server of benchmarks/baselines with a GET/SET cache around each request
("fastapi+redis"). The L1 holds 100,000 results, a
tenth of the key space. Workload: ``churn`` with Zipf(1.0) keys over 1,000,000 customers
(benchmarks/workloads/churn-zipf1m.yaml, SLO p99 50 ms).

Last, the hit path alone ("hit-path": 10,000 customers, who all fit in L1; each is asked for
once before the search, so that the search and the run at half capacity measure hits, not the
cold misses of a cache still filling).

For each: the SLO capacity (p99 under the SLO, no errors; the steps of the search draw new
requests of the same customers, so the cache warms as it would in service), then a run at
half that capacity: hit ratio per tier, p99 overall and of the hits alone (the hit path), and
the worker's own p99 from its request histogram (received to reply ready). After the hit path,
the measuring floor: the same requests at the same rate against a fixed reply on the worker's
HTTP stack (benchmarks/baselines/fixed_reply.py), the least this machine and generator show.

With ``--model ranker``: the ranker (500 candidates, features from the store in Redis in
every configuration) with Zipf(1.0) over 100,000 request keys (a key: one user and their own
candidates), SLO p99 30 ms.

    python benchmarks/cache_tiers.py [--model churn|ranker] [--duration 5] [--configs ...]
        [--l1-entries N]   (e.g. 10000, to compare the L1 policies where they must evict)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

import _harness as h

L1 = {"max_entries": 100_000, "max_bytes": 256 * 1024 * 1024}
BASE = {"enabled": True, "ttl_s": 600, "stale_s": 60}
CONFIGS: dict[str, dict[str, Any] | None] = {
    "no-cache": None,
    "redis-only": {**BASE, "l1": {**L1, "enabled": False}},
    "redis-only-lean": {**BASE, "l1": {**L1, "enabled": False}},
    "l1-lru+redis": {**BASE, "l1": {**L1, "policy": "lru"}},
    "l1-tinylfu+redis": {**BASE, "l1": {**L1, "policy": "tinylfu"}},
    # The hit path alone: 10,000 customers, all of whom fit in L1 once seen.
    "hit-path": {**BASE, "l1": {**L1, "policy": "tinylfu"}},
}
# Not a tailserve configuration: the tutorial server (churn only).
TUTORIAL = "fastapi+redis"
KEYS = {"hit-path": {"space": "zipf", "size": 10_000, "s": 1.0}}
# Before the hit path is measured, each of its keys is asked for once (key ids 0..size-1, the
# ids the Zipf draws use), at this rate: misses all, so within what the model can compute.
PREFILL_RPS = {"churn": 1000.0, "ranker": 250.0}
# Redis-only as the tutorials build it: the standard client (redis-py). Every other
# configuration, and "redis-only-lean" beside it, reaches Redis through the lean pipelined
# connection (tailserve.cache.resp).
FLAGS = {"redis-only": ["--redis-client", "redis-py"]}


# The ranker's variant: the same users come back (Zipf(1.0) over 100,000 request keys, each
# key one user with its own 500 candidates), so a result can be served again; its features
# come from the store in Redis in every configuration, no-cache included.
RANKER_KEYS = {"space": "zipf", "size": 100_000, "s": 1.0}


def measure(
    name: str, examples: Path, work: Path, out: Path, redis_url: str, args: argparse.Namespace
) -> dict[str, Any]:
    cache = CONFIGS.get(name)
    if cache is not None and args.l1_entries and name != "hit-path":
        cache = {**cache, "l1": {**cache["l1"], "max_entries": args.l1_entries}}
    model = args.model
    repo = h.one_model(examples / model, work / f"{model}-{name}", cache=cache or {})
    h.redis_command(redis_url, "FLUSHALL")
    port = h.free_port()
    if model == "ranker":
        load_features(examples / "ranker", redis_url)
        keys = {"keys": KEYS.get(name, RANKER_KEYS)}
        shipped = "ranker-500.yaml"
    else:
        keys = {"keys": KEYS[name]} if name in KEYS else {}
        if name == TUTORIAL:  # it has no config route: the generator reads the model.yaml
            keys["model_config"] = str(repo / model / "model.yaml")
        shipped = "churn-zipf1m.yaml"
    spec = h.workload(
        shipped, out, name=f"{model}-{name}", target=f"http://127.0.0.1:{port}", **keys
    )
    timing = ["--duration", str(args.duration), "--warmup", str(args.warmup)]
    needs_redis = cache or model == "ranker"
    flags = ["--redis-url", redis_url, *FLAGS.get(name, [])] if needs_redis else []
    print(f"\n=== {model}: {name} ===", flush=True)
    command, env = h.worker(repo, port, *flags), None
    if name == TUTORIAL:
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "fastapi_naive:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        env = {
            **os.environ,
            "BASELINE_MODEL_DIR": str(repo / model),
            "BASELINE_REDIS_URL": redis_url,
            "PYTHONPATH": str(h.HERE / "baselines"),
        }
    with h.serving(command, port, env=env):
        if name == "hit-path":
            prefill(shipped, out, model, port, KEYS[name]["size"])
        capacity = h.bench(
            spec,
            out / f"{model}-{name}.json",
            "--find-capacity",
            "--name",
            name,
            "--report",
            str(out / f"{model}-{name}.html"),
            *timing,
        )
        rps = (capacity["capacity"] or {}).get("rps") or 50.0
        before = server_histogram(port, name)
        half = h.bench(
            spec,
            out / f"{model}-{name}-half.json",
            "--rate",
            f"{rps / 2:.0f}",
            "--name",
            name,
            *timing,
            echo=False,
        )
        after = server_histogram(port, name)
    server = half.get("server") or {}
    tiers = server.get("cache") or {}
    total = max(1, sum(tiers.values()))
    hits = {tier: tiers.get(tier, 0) / total for tier in ("l1", "l2", "stale", "coalesced")}
    latency = server.get("cache_latency_ms") or {}
    return {
        "capacity": (capacity["capacity"] or {}).get("rps"),
        "half_rps": rps / 2,
        "half": half["overall"],
        "hits": hits,
        "miss": tiers.get("miss", 0) / total if tiers else 1.0,
        "l1_p99_ms": (latency.get("l1") or {}).get("p99"),
        "l2_p99_ms": (latency.get("l2") or {}).get("p99"),
        # The server's own account (received to reply ready), from its histogram.
        "server_p99_ms": server_p99(before, after),
        "spec": str(spec),
        "model_config": str(repo / model / "model.yaml"),
    }


# The server's time per request (received to reply ready); the tutorial server keeps none.
DURATION = "tailserve_request_duration_seconds"


def server_histogram(port: int, name: str) -> dict[float, float] | None:
    return None if name == TUTORIAL else h.histogram(f"http://127.0.0.1:{port}", DURATION)


def server_p99(before: dict[float, float] | None, after: dict[float, float] | None) -> float | None:
    if before is None or after is None:
        return None
    return h.histogram_quantile(before, after, 0.99) * 1e3


def floor(measured: dict[str, Any], out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same requests at the same rate against a fixed reply on the worker's own HTTP stack
    (benchmarks/baselines/fixed_reply.py): what this machine and generator show for a server
    that does nothing."""
    port = h.free_port()
    rate = measured["half_rps"]
    # The fixed reply has no configuration route: the generator reads the model.yaml.
    spec = h.workload(
        Path(measured["spec"]).name,
        out,
        name="floor",
        target=f"http://127.0.0.1:{port}",
        model_config=measured["model_config"],
        where=out,
    )
    command = [sys.executable, str(h.HERE / "baselines" / "fixed_reply.py"), "--port", str(port)]
    print(f"\n=== measuring floor: a fixed reply at {rate:,.0f} req/s ===", flush=True)
    with h.serving(command, port):
        result = h.bench(
            spec,
            out / "floor.json",
            "--rate",
            f"{rate:.0f}",
            "--name",
            "floor",
            "--duration",
            str(args.duration),
            "--warmup",
            str(args.warmup),
            echo=False,
        )
    overall: dict[str, Any] = result["overall"]
    return overall


def prefill(shipped: str, out: Path, model: str, port: int, size: int) -> None:
    """Ask for each of the first ``size`` keys once ("unique" keys count up from 0)."""
    rate = PREFILL_RPS[model]
    spec = h.workload(
        shipped,
        out,
        name=f"{model}-prefill",
        target=f"http://127.0.0.1:{port}",
        keys={"space": "unique"},
        schedule={"kind": "constant", "rate": rate},
    )
    seconds = size / rate * 1.02
    print(f"filling the cache: {size:,} keys at {rate:,.0f} req/s", flush=True)
    h.bench(
        spec,
        out / f"{model}-prefill.json",
        "--rate",
        str(rate),
        "--duration",
        f"{seconds:.2f}",
        "--warmup",
        "0",
        echo=False,
    )


def load_features(model_dir: Path, redis_url: str) -> None:
    code = "import sys; from tailserve.examples import load_features as f; f(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", code, str(model_dir), redis_url], check=True)


def report(results: dict[str, dict[str, Any]], model: str = "churn") -> None:
    head = (
        f"{'config':18}{'capacity':>10}{'vs redis':>9}{'vs tutor':>9}{'p99@half':>9}"
        f"{'server':>8}{'L1 hit':>8}{'L2 hit':>8}{'miss':>7}{'L1 p99':>8}"
        f"{'L2 p99':>8}"
    )
    if model == "ranker":
        print(
            "\nranker, 500 candidates, Zipf(1.0) over 100,000 request keys: SLO p99 <= 30 ms;"
            " at half of each capacity"
        )
    else:
        print("\nchurn, Zipf(1.0) over 1M customers: SLO p99 <= 50 ms; at half of each capacity")
    print(head)
    print("-" * len(head))
    redis_only = (results.get("redis-only") or {}).get("capacity") or 0.0
    tutorial = (results.get(TUTORIAL) or {}).get("capacity") or 0.0

    def ms(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    for name, r in results.items():
        if name == "floor":
            continue
        capacity = r["capacity"]
        ratio = f"{capacity / redis_only:.2f}x" if capacity and redis_only else "-"
        vs_tutorial = f"{capacity / tutorial:.2f}x" if capacity and tutorial else "-"
        print(
            f"{name:18}{(f'{capacity:,.0f}' if capacity else 'none'):>10}{ratio:>9}"
            f"{vs_tutorial:>9}"
            f"{ms(r['half']['p99_ms']):>9}{ms(r.get('server_p99_ms')):>8}"
            f"{r['hits']['l1']:>8.1%}{r['hits']['l2']:>8.1%}"
            f"{r['miss']:>7.1%}{ms(r['l1_p99_ms']):>8}{ms(r['l2_p99_ms']):>8}"
        )
    print(
        "p99@half: as the generator measures it; server: the worker's own p99 (received to "
        "reply ready)"
    )
    base = results.get("floor")
    if base is not None:
        print(
            f"measuring floor, a fixed reply on the same HTTP stack at {base['offered_rps']:,.0f}"
            f" req/s (the hit path's half): p50 {base['p50_ms']:.2f} ms, p99 "
            f"{base['p99_ms']:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("churn", "ranker"), default="churn")
    parser.add_argument("--configs", help="comma-separated (default: all of them)")
    parser.add_argument(
        "--l1-entries",
        type=int,
        default=0,
        help="L1 size (default 100,000); smaller than the keys a run touches, "
        "LRU and W-TinyLFU differ",
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per step")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/cache_tiers[-ranker]")
    args = parser.parse_args()
    if args.out is None:
        suffix = "" if args.model == "churn" else f"-{args.model}"
        args.out = h.HERE / "results" / f"cache_tiers{suffix}"
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tailserve-cache-"))
    examples = h.examples(work / "examples")
    results: dict[str, dict[str, Any]] = {}
    with h.redis(work) as redis_url:
        names = list(CONFIGS)
        if args.model == "churn":
            names.insert(1, TUTORIAL)
        for name in args.configs.split(",") if args.configs else names:
            results[name] = measure(name, examples, work, args.out, redis_url, args)
    hit_path = results.get("hit-path")
    if hit_path is not None and hit_path["capacity"]:
        results["floor"] = floor(hit_path, args.out, args)
    compared = [
        args.out / f"{args.model}-{n}.json" for n in results if n not in KEYS and n != "floor"
    ]
    if len(compared) > 1:
        h.compare(compared, args.out / "compare.html")
    print("\n\nSummary")
    report(results, args.model)
    (args.out / "summary.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(f"\nresults and reports: {args.out}")


if __name__ == "__main__":
    main()
