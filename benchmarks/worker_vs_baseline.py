"""The worker against a naive FastAPI server, side by side in one run, with `tailserve bench`.

For each model, three servers run in turn on the same machine (never at once: they would share
the two cores), each measured by `tailserve bench --find-capacity` with unique churn inputs (no
cache can help), open loop, p99 SLO 50 ms:

  (a) tailserve, batching on        (the model's default policy, up to 256 rows a batch)
  (b) tailserve, batching off       (each request runs alone)
  (c) naive FastAPI                 (benchmarks/baselines/fastapi_naive.py: pydantic, and each
                                     request scored alone in the event loop)

Models: ``churn`` (the ONNX graph, ~25 µs a call) and ``churn_sklearn`` (the scikit-learn
pipeline it was exported from, ~1.3 ms a call whatever the batch size: what most tutorials
serve). Prints each server's load curve (offered, achieved, p50, p99), its SLO capacity, the
ratio of (a)'s capacity to (c)'s, then `tailserve bench compare` of the three; writes the
results and HTML reports under --out.

    python benchmarks/worker_vs_baseline.py [--models churn,churn_sklearn] [--duration 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

import _harness as h

SERVERS = ("tailserve-batched", "tailserve-unbatched", "fastapi-naive")


def repositories(work: Path) -> dict[str, Path]:
    """The examples (with the sklearn pipeline) twice: batching on, batching off."""
    source = h.examples(work / "examples", "--sklearn")
    repos = {}
    for kind, enabled in (("batched", True), ("unbatched", False)):
        repo = work / kind
        shutil.copytree(source, repo)
        for config_path in repo.glob("*/model.yaml"):
            config = yaml.safe_load(config_path.read_text())
            config["batching"]["enabled"] = enabled
            config.pop("cache", None)  # unique inputs: the baselines have no cache either
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        repos[kind] = repo
    return repos


def command(server: str, model: str, repos: dict[str, Path], port: int) -> list[str]:
    if server.startswith("tailserve"):
        repo = repos["batched" if server == "tailserve-batched" else "unbatched"]
        # One model per worker, so the others' warm-up and memory are not in the figure.
        only = repo.parent / f"{server}-{model}"
        if not only.exists():
            only.mkdir()
            shutil.copytree(repo / model, only / model)
        return h.worker(only, port)
    return [
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


def bench(
    server: str, model: str, repos: dict[str, Path], out: Path, args: argparse.Namespace
) -> dict[str, Any]:
    port = h.free_port()
    spec = h.workload(
        "churn-unique.yaml",
        out,
        name=f"{model}-{server}",
        model=model,
        target=f"http://127.0.0.1:{port}",
        model_config=str(repos["batched"] / model / "model.yaml"),
        schedule={"kind": "poisson", "rate": args.start_rate},
        connections=args.connections,
    )
    env = {
        **os.environ,
        "BASELINE_MODEL_DIR": str(repos["batched"] / model),
        "PYTHONPATH": str(h.HERE / "baselines"),
    }
    print(f"\n=== {model}: {server} ===", flush=True)
    with h.serving(command(server, model, repos, port), port, env=env):
        return h.bench(
            spec,
            out / f"{model}-{server}.json",
            "--find-capacity",
            "--duration",
            str(args.duration),
            "--warmup",
            str(args.warmup),
            "--name",
            server,
            "--report",
            str(out / f"{model}-{server}.html"),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="churn,churn_sklearn")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per step")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--start-rate", type=float, default=200.0)
    parser.add_argument(
        "--connections",
        type=int,
        default=256,
        help="generator connections (the figures in docs used 256)",
    )
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "worker_vs_baseline")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    repos = repositories(Path(tempfile.mkdtemp(prefix="tailserve-wvb-")))
    summary = []
    for model in args.models.split(","):
        results = {server: bench(server, model, repos, args.out, args) for server in SERVERS}
        print(f"\n=== {model}: tailserve bench compare ===", flush=True)
        h.compare(
            [args.out / f"{model}-{server}.json" for server in SERVERS],
            args.out / f"{model}-compare.html",
        )
        summary.append((model, results))
    print("\n\nSummary: SLO capacity (p99 <= 50 ms, no errors), unique inputs, open loop")
    print(f"{'model':15}" + "".join(f"{s:>22}" for s in SERVERS) + f"{'(a)/(c)':>10}")
    for model, results in summary:
        capacity = [(results[s]["capacity"] or {}).get("rps") or 0.0 for s in SERVERS]
        ratio = capacity[0] / capacity[2] if capacity[2] else float("inf")
        bound = ["*" if results[s]["generator"]["cpu_bound"] else "" for s in SERVERS]
        cells = "".join(f"{c:>21,.0f}{b or ' '}" for c, b in zip(capacity, bound, strict=True))
        print(f"{model:15}{cells}{ratio:>9.1f}x")
    if any(r["generator"]["cpu_bound"] for _, results in summary for r in results.values()):
        print("* the generator was CPU-bound at that step: the figure is a lower bound")
    print(f"\nresults and reports: {args.out}")


if __name__ == "__main__":
    main()
