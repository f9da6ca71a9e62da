"""The stack on a GPU machine: `tailserve up` with one worker a GPU, the torch example on CUDA,
against the same stack on the CPU (`--gpus none`), side by side.

For each: the log line that maps workers to GPUs, then ``--requests`` sequential requests of
one churn customer through the front door (end-to-end p50/p99, the worker's compute time),
then bursts of ``--burst`` concurrent requests (the batches the worker formed). Writes
`$OUT/gpu_stack.json` when OUT is set. Needs torch; on a machine with no GPU both runs are on
the CPU and the first says so.

    PYTHONPATH=src python benchmarks/gpu_stack.py [--requests 300] [--burst 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from _harness import free_port, serving
from tailserve.examples.churn import sample_rows
from tailserve.examples.churn_torch import INPUTS, write_churn_torch


def body(row: dict[str, Any]) -> bytes:
    inputs = [
        {"name": f.name, "datatype": f.datatype, "shape": [1, 1], "data": [row[f.name]]}
        for f in INPUTS
    ]
    return json.dumps({"inputs": inputs}).encode()


def post(url: str, data: bytes) -> tuple[float, dict[str, str]]:
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as reply:
        reply.read()
        headers = {k.lower(): v for k, v in reply.headers.items()}
    return (time.perf_counter() - started) * 1e3, headers


def one_stack(repository: Path, gpus: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    command = [
        *("python3", "-m", "tailserve.cli", "up", "--repository", str(repository)),
        *("--port", str(port), "--grpc-port", "0", "--hedge-lane-ms", "0", "--gpus", gpus),
    ]
    with log.open("w") as sink, serving(command, port, stdout=sink, stderr=sink) as url:
        infer = f"{url}/v2/models/churn_torch/infer"
        count = args.requests + args.burst  # (the burst's rows unseen: no cache hits)
        columns = sample_rows(count, seed=3)
        rows = [body({n: c[i] for n, c in columns.items()}) for i in range(count)]
        ready_by = time.monotonic() + 120
        while True:  # (the front door may be ready before its check has seen the model's)
            try:
                post(infer, rows[0])
                break
            except urllib.error.HTTPError as exc:
                if exc.code != 503 or time.monotonic() > ready_by:
                    raise
                time.sleep(0.2)
        for data in rows[:20]:
            post(infer, data)
        timed = [post(infer, data) for data in rows[: args.requests]]
        with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
            burst = list(pool.map(lambda d: post(infer, d), rows[args.requests :]))
    latencies = sorted(ms for ms, _ in timed)
    lines = [line for line in log.read_text().splitlines() if "GPU" in line or "CUDA" in line]
    return {
        "gpus": gpus,
        "log": lines[:5],
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))],
        "compute_us_median": statistics.median(int(h["x-compute-us"]) for _, h in timed),
        "variants": sorted({h.get("x-variant", "") for _, h in timed}),
        "burst_batch_sizes": sorted({int(h["x-batch-size"]) for _, h in burst}),
        "burst_p99_ms": sorted(ms for ms, _ in burst)[int(0.99 * (len(burst) - 1))],
    }


def repository(directory: Path, device: str) -> Path:
    write_churn_torch(directory)
    path = directory / "churn_torch" / "model.yaml"
    config = yaml.safe_load(path.read_text())
    config["instances"]["providers"] = [device]
    if device == "cuda":  # (dynamic INT8 is CPU-only: the GPU serves the full model)
        config["variants"]["choices"] = config["variants"]["choices"][:1]
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--burst", type=int, default=64)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for gpus, device in (("auto", "cuda"), ("none", "cpu")):
            found = one_stack(repository(Path(tmp) / device, device), gpus, args)
            results.append(found)
            print(json.dumps(found))
    gpu, cpu = results
    print(
        f"end-to-end p50: GPU stack {gpu['p50_ms']:.2f} ms, CPU stack {cpu['p50_ms']:.2f} ms; "
        f"compute {gpu['compute_us_median']} us vs {cpu['compute_us_median']} us"
    )
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_stack.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
