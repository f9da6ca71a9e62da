"""What the benchmark scripts share: servers as child processes and `tailserve bench` runs."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads"
QUIET: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
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


@contextlib.contextmanager
def serving(command: Sequence[str], port: int, **popen: Any) -> Iterator[str]:
    """A server process until the block ends; yields its URL once it is ready."""
    with server_process(command, port, **popen) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(
    command: Sequence[str], port: int, **popen: Any
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`serving`, yielding the process as well (to read its CPU time: `cpu_seconds`)."""
    process = subprocess.Popen(list(command), **{**QUIET, **popen})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=60)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return orjson.loads(reply.read())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used, all its threads (Linux: /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_group(process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to a process started in a session of its own and everything in it; SIGKILL
    after ``timeout``. Then SIGKILL what is left of its tree as it was (children in sessions or
    groups of their own, as BentoML's workers and Ray's are) after ``timeout`` more."""
    tree = {pid: _started(pid) for pid in process_tree(process.pid)[1:]}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + timeout
    while left := [pid for pid, started in tree.items() if started and _started(pid) == started]:
        if time.monotonic() > deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.1)


def _started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot: with the pid, who it is); None if it is
    gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def models_alone(examples: Path, into: Path, models: Sequence[str]) -> Path:
    """The models copied from ``examples`` into ``into`` (kept if there already), their result
    caches off and their variants gone: every request computed by the whole model."""
    for name in models:
        target = into / name
        if target.exists():
            continue
        shutil.copytree(examples / name, target)
        path = target / "model.yaml"
        config = yaml.safe_load(path.read_text())
        config["cache"] = {}
        config.pop("variants", None)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return into


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (Linux: /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue += children.get(pid, [])
    return found


def worker(repository: Path, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tailserve.cli",
        "serve",
        "--repository",
        str(repository),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]


def up_command(repository: Path, port: int, *flags: str) -> list[str]:
    """`tailserve up` on ``port`` (no gRPC, no hedging lane, quiet)."""
    return [
        sys.executable,
        "-m",
        "tailserve.cli",
        "up",
        "--repository",
        str(repository),
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--hedge-lane-ms",
        "0",
        "--log-level",
        "warning",
        *flags,
    ]


@contextlib.contextmanager
def up_stack(repository: Path, *flags: str) -> Iterator[str]:
    """`tailserve up` on a free port (`up_command`, in a session of its own) until the block
    ends; yields the front door's URL once it is ready."""
    port = free_port()
    with serving(up_command(repository, port, *flags), port, start_new_session=True) as url:
        yield url


def examples(directory: Path, *flags: str) -> Path:
    command = [sys.executable, "-m", "tailserve.cli", "examples", str(directory), *flags]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return directory


def one_model(
    source: Path,
    into: Path,
    batching: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
) -> Path:
    """A repository of one model copied from ``source`` (a model folder), with its batching
    and cache settings changed (``cache`` replaces the whole section; {} turns it off)."""
    target = into / source.name
    shutil.copytree(source, target)
    config_path = target / "model.yaml"
    config = yaml.safe_load(config_path.read_text())
    if batching:
        config["batching"] = {**config.get("batching", {}), **batching}
    if cache is not None:
        config["cache"] = cache
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return into


@contextlib.contextmanager
def redis(workdir: Path) -> Iterator[str]:
    """A private redis-server on a free loopback port for one benchmark; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    process = subprocess.Popen(command, **QUIET)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


def redis_command(url: str, *args: str) -> bytes:
    """One command to the Redis at ``url`` (RESP over a socket; no client library needed)."""
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    host, port = host_port.rsplit(":", 1)
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(payload.encode())
        return conn.recv(65536)


def histogram(url: str, family: str) -> dict[float, float]:
    """A Prometheus histogram of the server at ``url``, its label sets summed: upper bound ->
    cumulative count."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    for metrics in text_string_to_metric_families(text):
        if metrics.name != family:
            continue
        for sample in metrics.samples:
            if sample.name == f"{family}_bucket":
                upper = float(sample.labels["le"])  # "+Inf" reads as inf
                buckets[upper] = buckets.get(upper, 0.0) + sample.value
    return buckets


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The ``q`` quantile of what was observed between two snapshots, interpolated within its
    bucket as Prometheus does; NaN if nothing was."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def workload(shipped: str, out: Path, where: Path = WORKLOADS, **changes: Any) -> Path:
    """A shipped workload (or one in ``where``) with fields changed, written beside the
    results."""
    spec = yaml.safe_load((where / shipped).read_text())
    spec.update(changes)
    path = out / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def bench(spec: Path, result: Path, *flags: str, echo: bool = True) -> dict[str, Any]:
    """`tailserve bench` as its own process; the JSON result."""
    command = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "bench",
        str(spec),
        "--quiet",
        "--out",
        str(result),
        *flags,
    ]
    subprocess.run(command, check=True, **({} if echo else QUIET))
    document: dict[str, Any] = orjson.loads(result.read_bytes())
    return document


def compare(results: Sequence[Path], report: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "bench",
        "compare",
        *map(str, results),
        "--report",
        str(report),
    ]
    subprocess.run(command, check=True)


def rounds_parser(
    doc: str, models: Sequence[str], out: str, *, duration: float, rate_help: str
) -> argparse.ArgumentParser:
    """The options of a benchmark that alternates configurations at one fixed rate."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", choices=tuple(models), default=models[0])
    parser.add_argument("--rate", type=float, help=rate_help)
    parser.add_argument("--duration", type=float, default=duration, help="seconds a round")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / out)
    return parser


def rounds_args(parser: argparse.ArgumentParser, rates: dict[str, float]) -> argparse.Namespace:
    """Parse `rounds_parser`'s options: the model's default rate filled in, the output folder
    made."""
    args = parser.parse_args()
    args.rate = args.rate or rates[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (no display), or None, said, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no plot)")
        return None
    return plt


def wait_served(
    url: str,
    model: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    timeout_s: float = 60.0,
) -> None:
    """Until ``url`` answers ``model``'s requests with 20 200s in a row: the stack reports ready
    a moment before the front door's checks of the workers' models do (the first run would count
    503s), and a model's first requests may read what it needs (a retrieval index)."""
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while in_a_row < 20:
        request = urllib.request.Request(
            f"{url}/v2/models/{model}/infer",
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                in_a_row = in_a_row + 1 if reply.status == 200 else 0
        except OSError:
            in_a_row = 0
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model} is not served through {url}") from None
            time.sleep(0.2)
