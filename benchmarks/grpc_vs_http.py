"""The worker's protocols side by side in one run: OIP v2 over HTTP (JSON, binary) and gRPC,
called directly and through the router.

One worker serves `churn` (ONNX, nine one-value inputs, no cache: every request computed) with
its HTTP and gRPC ports open; a router (`tailserve route --no-hedge`) in front of it takes HTTP
and gRPC too, and sends both on to the worker over HTTP ("router-http-binary", "router-grpc":
what the router's gRPC front costs beside its HTTP proxying). A closed loop of
``--concurrency`` requests in flight calls over each protocol in turn, ``--rounds`` rounds of
``--duration`` seconds each: requests a second, the client's p50 / p99, and the worker's CPU
time per request (both threads, from /proc): the figure that says what a protocol costs the
server, least moved by the client sharing these cores; through the router, the router's CPU
time per request as well. The clients send prepared bytes (the same 64 distinct requests over
and over), so that the client's cost stays out of the way: HTTP through tailserve's own
kept-alive HTTP/1.1 pool, gRPC through grpcio's asyncio channel.

    python benchmarks/grpc_vs_http.py [--concurrency 8] [--duration 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.http as triton_http

import _harness as h
from tailserve.examples.churn import sample_rows
from tailserve.protocols.grpc import schema
from tailserve.tensors import to_binary
from tailserve.transport.http1 import Pool, frame_request

FIELDS = {
    "tenure_months": "INT64",
    "monthly_spend": "FP32",
    "support_tickets": "INT64",
    "feature_usage_pct": "FP32",
    "last_login_days_ago": "INT64",
    "num_integrations": "INT64",
    "contract_type": "BYTES",
    "plan_tier": "BYTES",
    "is_enterprise": "INT64",
}
PROTOCOLS = ("http-json", "http-binary", "grpc", "router-http-binary", "router-grpc")
DISTINCT = 64


def columns(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    sample = sample_rows(1, seed)
    out = {}
    for name, datatype in FIELDS.items():
        if datatype == "BYTES":
            out[name] = np.array([str(sample[name][0]).encode()], dtype=object).reshape(1, 1)
        else:
            dtype = np.float32 if datatype == "FP32" else np.int64
            out[name] = np.asarray(sample[name], dtype=dtype).reshape(1, 1)
    return out


def http_requests(port: int, binary: bool) -> list[bytes]:
    """Framed HTTP/1.1 requests, as tritonclient.http would send them."""
    framed = []
    for seed in range(DISTINCT):
        inputs = []
        for name, array in columns(seed).items():
            tensor = triton_http.InferInput(name, [1, 1], FIELDS[name])
            tensor.set_data_from_numpy(array, binary_data=binary)
            inputs.append(tensor)
        outputs = [triton_http.InferRequestedOutput("churn_probability", binary_data=binary)]
        body, json_size = triton_http.InferenceServerClient.generate_request_body(
            inputs, outputs=outputs
        )
        headers = [("content-type", "application/octet-stream" if binary else "application/json")]
        if json_size is not None:
            headers.append(("inference-header-content-length", str(json_size)))
        framed.append(
            frame_request("POST", "/v2/models/churn/infer", f"127.0.0.1:{port}", body, headers)
        )
    return framed


def grpc_requests() -> list[bytes]:
    """Serialized ModelInferRequests, inputs as raw contents (what tritonclient.grpc sends)."""
    messages = []
    for seed in range(DISTINCT):
        request = schema.ModelInferRequest(model_name="churn")
        for name, array in columns(seed).items():
            request.inputs.add(name=name, datatype=FIELDS[name], shape=[1, 1])
            request.raw_input_contents.append(to_binary(array))
        messages.append(request.SerializeToString())
    return messages


async def closed_loop(
    call: Any, requests: list[bytes], concurrency: int, seconds: float
) -> list[float]:
    """``concurrency`` callers, each sending its next request as soon as the last answered;
    answers every latency (seconds)."""
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def caller(offset: int) -> None:
        i = offset
        while time.perf_counter() < stop:
            started = time.perf_counter()
            await call(requests[i % len(requests)])
            latencies.append(time.perf_counter() - started)
            i += concurrency

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return latencies


async def round_of(
    protocol: str, ports: dict[str, int], pids: dict[str, int], args: argparse.Namespace
) -> dict[str, float]:
    routed = protocol.startswith("router-")
    side = "router" if routed else "worker"
    http_port, grpc_port = ports[f"{side}-http"], ports[f"{side}-grpc"]
    if protocol.endswith("grpc"):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        method = channel.unary_unary(f"/{schema.SERVICE}/ModelInfer")
        requests = grpc_requests()

        async def call(data: bytes) -> None:
            await method(data)

        close: Any = channel.close
    else:
        pool = Pool("127.0.0.1", http_port, max_connections=args.concurrency)
        requests = http_requests(http_port, binary=protocol.endswith("http-binary"))

        async def call(data: bytes) -> None:
            response = await pool.request(data)
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.body[:200]!r}")

        close = pool.close
    try:
        await closed_loop(call, requests, args.concurrency, args.warmup)
        before = {name: h.cpu_seconds(pid) for name, pid in pids.items()}
        latencies = await closed_loop(call, requests, args.concurrency, args.duration)
        cpu = {name: h.cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    finally:
        await close()
    ms = np.array(latencies) * 1e3
    return {
        "rps": len(latencies) / args.duration,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "cpu_us": cpu["worker"] / len(latencies) * 1e6,
        "router_cpu_us": cpu["router"] / len(latencies) * 1e6 if routed else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds a round")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples = h.examples(work / "examples")
        repo = h.one_model(examples / "churn", work / "repo", cache={})
        ports = {
            name: h.free_port()
            for name in ("worker-http", "worker-grpc", "router-http", "router-grpc")
        }
        command = h.worker(repo, ports["worker-http"], "--grpc-port", str(ports["worker-grpc"]))
        route = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "route",
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["router-http"]),
            "--grpc-port",
            str(ports["router-grpc"]),
            "--no-hedge",
            "--log-level",
            "warning",
            f"--backend=http://127.0.0.1:{ports['worker-http']}",
        ]
        with (
            h.server_process(command, ports["worker-http"]) as (_, worker),
            h.server_process(route, ports["router-http"]) as (_, router),
        ):
            pids = {"worker": worker.pid, "router": router.pid}
            results: dict[str, list[dict[str, float]]] = {p: [] for p in PROTOCOLS}
            for index in range(args.rounds):
                order = PROTOCOLS if index % 2 == 0 else PROTOCOLS[::-1]
                for protocol in order:
                    result = asyncio.run(round_of(protocol, ports, pids, args))
                    results[protocol].append(result)
                    print(
                        f"round {index + 1} {protocol:18} {result['rps']:8,.0f} req/s  "
                        f"p50 {result['p50_ms']:6.2f} ms  p99 {result['p99_ms']:6.2f} ms  "
                        f"worker CPU {result['cpu_us']:6.0f} µs/req  "
                        f"router CPU {result['router_cpu_us']:5.0f} µs/req",
                        flush=True,
                    )
    print(f"\nmedians of {args.rounds} rounds, {args.concurrency} in flight, churn, one worker:")
    medians = {
        p: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for p, rs in results.items()
    }
    base = medians["http-json"]
    for protocol, m in medians.items():
        print(
            f"{protocol:18} {m['rps']:8,.0f} req/s ({m['rps'] / base['rps']:.2f}x)  "
            f"p50 {m['p50_ms']:6.2f} ms  p99 {m['p99_ms']:6.2f} ms  "
            f"worker CPU {m['cpu_us']:6.0f} µs/req ({m['cpu_us'] / base['cpu_us']:.2f}x)  "
            f"router CPU {m['router_cpu_us']:5.0f} µs/req"
        )
    routed = medians["router-grpc"]["router_cpu_us"], medians["router-http-binary"]["router_cpu_us"]
    if routed[1]:
        print(f"router CPU per request, gRPC front / HTTP binary: {routed[0] / routed[1]:.2f}x")


if __name__ == "__main__":
    main()
