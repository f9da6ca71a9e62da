"""The worker against a naive FastAPI server, side by side in one run, with `tailserve bench`.

For each model, three servers run in turn on the same machine (never at once: they would share
the two cores), each measured by `tailserve bench --find-capacity` with unique churn inputs (no
cache can help), open loop, p99 SLO 50 ms:

  (a) tailserve, batching on        (size-or-timeout, max 1 ms wait, up to 256 rows)
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
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "workloads" / "churn-unique.yaml"
SERVERS = ("tailserve-batched", "tailserve-unbatched", "fastapi-naive")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def repositories(work: Path) -> dict[str, Path]:
    """The examples (with the sklearn pipeline) twice: batching on, batching off."""
    source = work / "examples"
    subprocess.run([sys.executable, "-m", "tailserve.cli", "examples", str(source), "--sklearn"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    repos = {}
    for kind, enabled in (("batched", True), ("unbatched", False)):
        repo = work / kind
        shutil.copytree(source, repo)
        for config_path in repo.glob("*/model.yaml"):
            config = yaml.safe_load(config_path.read_text())
            config["batching"]["enabled"] = enabled
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        repos[kind] = repo
    return repos


def start(server: str, model: str, repos: dict[str, Path], port: int) -> subprocess.Popen[bytes]:
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if server.startswith("tailserve"):
        repo = repos["batched" if server == "tailserve-batched" else "unbatched"]
        # One model per worker, so the other's warm-up and memory are not in the figure.
        only = repo.parent / f"{server}-{model}"
        if not only.exists():
            only.mkdir()
            shutil.copytree(repo / model, only / model)
        command = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "serve",
            "--repository",
            str(only),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--log-level",
            "warning",
        ]
        return subprocess.Popen(command, **quiet)  # type: ignore[call-overload, no-any-return]
    env = {**os.environ, "BASELINE_MODEL_DIR": str(repos["batched"] / model),
           "PYTHONPATH": str(HERE / "baselines")}  # fmt: skip
    command = [sys.executable, "-m", "uvicorn", "fastapi_naive:app", "--host", "127.0.0.1",
               "--port", str(port), "--no-access-log", "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(command, env=env, **quiet)  # type: ignore[call-overload, no-any-return]


def bench(server: str, model: str, repos: dict[str, Path], out: Path,
          args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workload = yaml.safe_load(WORKLOAD.read_text())
    workload.update(name=f"{model}-{server}", model=model, target=url,
                    model_config=str(repos["batched"] / model / "model.yaml"),
                    schedule={"kind": "poisson", "rate": args.start_rate})  # fmt: skip
    spec = out / f"{model}-{server}.yaml"
    spec.write_text(yaml.safe_dump(workload, sort_keys=False))
    result = out / f"{model}-{server}.json"
    process = start(server, model, repos, port)
    try:
        wait_ready(url, process)
        command = [sys.executable, "-m", "tailserve.cli", "bench", str(spec), "--find-capacity",
                   "--duration", str(args.duration), "--warmup", str(args.warmup), "--quiet",
                   "--name", server, "--out", str(result),
                   "--report", str(out / f"{model}-{server}.html")]  # fmt: skip
        print(f"\n=== {model}: {server} ===", flush=True)
        subprocess.run(command, check=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    document: dict[str, Any] = orjson.loads(result.read_bytes())
    return document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="churn,churn_sklearn")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per step")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--start-rate", type=float, default=200.0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "worker_vs_baseline")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tailserve-wvb-"))
    repos = repositories(work)
    summary = []
    for model in args.models.split(","):
        results = {server: bench(server, model, repos, args.out, args) for server in SERVERS}
        files = [str(args.out / f"{model}-{server}.json") for server in SERVERS]
        print(f"\n=== {model}: tailserve bench compare ===", flush=True)
        subprocess.run([sys.executable, "-m", "tailserve.cli", "bench", "compare", *files,
                        "--report", str(args.out / f"{model}-compare.html")],
                       check=True)  # fmt: skip
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
