"""What the HTTP stack costs per request: server CPU time, side by side in one run.

The server's own CPU (user + system, read from /proc) divided by the requests it answered does
not depend on how fast the client is, so it is steadier on a shared 2-core machine than latency.
Compared: a bare ASGI callable, the same behind Starlette and behind FastAPI+pydantic (all on
uvicorn + httptools + uvloop), and tailserve's worker on its health route and an infer route
(a trivial model, so the figure is the serving path, not the model).

    python benchmarks/http_overhead.py [--requests 4000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import orjson

from _harness import free_port

HERE = Path(__file__).resolve().parent
BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]})

APPS = """
import orjson
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

REPLY = orjson.dumps(
    {"outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [3.0]}]}
)


async def bare(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(REPLY)).encode())]})
    await send({"type": "http.response.body", "body": REPLY})


async def _starlette_infer(request):
    orjson.loads(await request.body())
    return Response(REPLY, media_type="application/json")

starlette_app = Starlette(routes=[Route("/v2/models/m/infer", _starlette_infer, methods=["POST"])])


class Tensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[float]


class Request(BaseModel):
    inputs: list[Tensor]


fastapi_app = FastAPI()


@fastapi_app.post("/v2/models/m/infer")
async def _fastapi_infer(request: Request):
    return Response(REPLY, media_type="application/json")
"""

IDENTITY = """
import numpy as np

class Model:
    def predict(self, inputs):
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""

IDENTITY_YAML = """
runtime: python
max_batch_size: {mbs}
inputs: [{{name: x, datatype: FP32, shape: [1]}}]
outputs: [{{name: y, datatype: FP32, shape: [1]}}]
batching: {{enabled: {enabled}, max_queue_delay_ms: 0}}
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def drive(port: int, method: str, path: str, body: bytes, count: int, conns: int) -> int:
    """Closed-loop keep-alive load; returns how many 200s came back."""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    remaining = count
    ok = 0

    async def one_connection() -> None:
        nonlocal remaining, ok
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while remaining > 0:
            remaining -= 1
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            ok += head.startswith(b"HTTP/1.1 200")
        writer.close()

    await asyncio.gather(*(one_connection() for _ in range(conns)))
    return ok


def wait_listening(port: int, path: str, timeout: float = 60.0) -> None:
    """Until GET ``path`` answers 200 (tailserve's readiness), or anything at all for "*"."""
    expect = b"HTTP/1.1 " if path == "*" else b"HTTP/1.1 200"
    path = "/" if path == "*" else path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                if conn.recv(64).startswith(expect):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"server on {port} did not become ready")


def measure(
    command: list[str],
    port: int,
    ready: str,
    method: str,
    path: str,
    body: bytes,
    args: argparse.Namespace,
    env: dict[str, str],
) -> float:
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_listening(port, ready)
        asyncio.run(drive(port, method, path, body, args.requests // 4, args.concurrency))
        before = cpu_seconds(process.pid)
        ok = asyncio.run(drive(port, method, path, body, args.requests, args.concurrency))
        used = cpu_seconds(process.pid) - before
        if ok != args.requests:
            raise RuntimeError(f"{command}: only {ok} of {args.requests} answered 200")
        return used / args.requests * 1e6
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the servers this often")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tailserve-http-"))
    (work / "apps.py").write_text(textwrap.dedent(APPS))
    for name, mbs, enabled in (("batched", 64, "true"), ("unbatched", 64, "false")):
        (work / "repo" / name / "1").mkdir(parents=True)
        (work / "repo" / name / "model.yaml").write_text(
            IDENTITY_YAML.format(mbs=mbs, enabled=enabled)
        )
        (work / "repo" / name / "1" / "model.py").write_text(textwrap.dedent(IDENTITY))
    # The apps beside whatever tailserve is on the path already (a checkout's src, say).
    path = [str(work), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    uvicorn = [
        sys.executable,
        "-m",
        "uvicorn",
        "--http",
        "httptools",
        "--loop",
        "uvloop",
        "--no-access-log",
        "--log-level",
        "warning",
    ]

    def case(name: str) -> tuple[list[str], int, str, str, str, bytes]:
        port = free_port()
        infer = "/v2/models/m/infer"
        if name in ("bare ASGI", "Starlette", "FastAPI+pydantic"):
            target = {
                "bare ASGI": "apps:bare",
                "Starlette": "apps:starlette_app",
                "FastAPI+pydantic": "apps:fastapi_app",
            }[name]
            return [*uvicorn, "--port", str(port), target], port, "*", "POST", infer, BODY
        serve = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "serve",
            "--repository",
            str(work / "repo"),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--log-level",
            "warning",
        ]
        if name == "tailserve GET /v2/health/live":
            return serve, port, "/v2/health/ready", "GET", "/v2/health/live", b""
        model = "batched" if "batched" in name and "unbatched" not in name else "unbatched"
        path = f"/v2/models/{model}/infer"
        return serve, port, "/v2/health/ready", "POST", path, BODY

    names = [
        "bare ASGI",
        "Starlette",
        "FastAPI+pydantic",
        "tailserve GET /v2/health/live",
        "tailserve infer, unbatched",
        "tailserve infer, batched",
    ]
    results: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            command, port, ready, method, path, body = case(name)
            results[name].append(measure(command, port, ready, method, path, body, args, env))
    bare = min(results["bare ASGI"])
    print(
        f"\nserver CPU per request ({args.requests} requests, {args.concurrency} connections, "
        f"best of {args.rounds} alternating rounds)"
    )
    print(f"{'server':34} {'CPU µs/req':>11} {'x bare ASGI':>12}")
    for name in names:
        best = min(results[name])
        print(f"{name:34} {best:11.1f} {best / bare:12.2f}")


if __name__ == "__main__":
    main()
