"""Real servers on loopback for tests: a worker in a thread, a worker process, redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tailserve.assembly.worker import Worker
from tailserve.loops import run
from tailserve.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll until ``predicate()`` holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class RunningWorker:
    worker: Worker
    url: str
    port: int


@contextlib.contextmanager
def run_worker(
    settings: Settings, *, wait_ready: bool = True, host: str = "127.0.0.1"
) -> Iterator[RunningWorker]:
    """A worker on an unused port, in a thread with its own event loop. It listens on
    ``host`` (an IPv4 address: loopback, or 0.0.0.0 for a worker reached beyond it); the
    test reaches it on 127.0.0.1."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    # gRPC only where a test asks for it on a port of its own (the default 8001 is shared).
    grpc_port = 0 if settings.grpc_port == Settings().grpc_port else settings.grpc_port
    worker = Worker(settings.replace(host=host, http_port=port, grpc_port=grpc_port))
    failure: list[BaseException] = []

    def target() -> None:
        try:
            run(worker.serve(sockets=[sock]))
        except BaseException as exc:  # surfaced to the test below
            failure.append(exc)

    thread = threading.Thread(target=target, name=f"worker-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: failure != [] or _answers(url), what=f"worker on {url} to listen")
        if failure:
            raise failure[0]
        if wait_ready:
            wait_for(lambda: worker.loaded.is_set(), what="models to load")
        yield RunningWorker(worker, url, port)
    finally:
        worker.request_exit()
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "worker thread did not stop"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/live", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


@contextlib.contextmanager
def worker_process(
    repository: Path, log_dir: Path, *extra: str, wait_ready: bool = True
) -> Iterator[WorkerProcess]:
    """``tailserve serve`` as a real child process, for signals and exit codes."""
    port = free_port()
    log_path = log_dir / f"worker-{port}.log"
    grpc = [] if "--grpc-port" in extra else ["--grpc-port", "0"]
    command = [
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
        *grpc,
        *extra,
    ]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    running = WorkerProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        check = _ready if wait_ready else _answers
        wait_for(lambda: process.poll() is not None or check(running.url), what="worker process")
        if process.poll() is not None:
            raise AssertionError(f"worker exited with {process.returncode}:\n{running.log()}")
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class RedisServer:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisServer]:
    """A private redis-server on a free loopback port; it keeps nothing on disk."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed: the Redis tests need it on PATH "
            "(Debian/Ubuntu: apt-get install redis-server)"
        )
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
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: process.poll() is not None or _pings(port), what="redis-server")
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        yield RedisServer(process, port)
    finally:
        process.terminate()
        process.wait(timeout=10)


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# --- Redis for fault tests and Redis Cluster ------------------------------------------------
#
# The session's ``redis`` above is shared; a test that pauses, kills or restarts Redis gets a
# server of its own (``own_redis_server``) so the other tests never see the fault.


def start_redis(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """redis-server on ``port`` keeping nothing on disk, once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed: the Redis tests need it on PATH "
            "(Debian/Ubuntu: apt-get install redis-server)"
        )
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
        *extra,
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: process.poll() is not None or _pings(port), what=f"redis-server :{port}")
    except BaseException:
        stop_redis(process)
        raise
    if process.poll() is not None:
        raise RuntimeError(f"redis-server on port {port} exited with {process.returncode}")
    return process


def stop_redis(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait(timeout=10)


@dataclass
class OwnRedisServer(RedisServer):
    """A redis-server of one test's own: it may be paused, killed and restarted."""

    workdir: Path


@contextlib.contextmanager
def own_redis_server(workdir: Path) -> Iterator[OwnRedisServer]:
    """A redis-server for one test to pause, kill and restart; stopped at the end, whichever
    process (after restarts) is serving then."""
    port = free_port()
    server = OwnRedisServer(start_redis(port, workdir), port, workdir)
    try:
        yield server
    finally:
        stop_redis(server.process)


def pause_redis(server: RedisServer) -> None:
    """SIGSTOP: the server keeps its connections but answers nothing until ``resume_redis``."""
    server.process.send_signal(signal.SIGSTOP)


def resume_redis(server: RedisServer) -> None:
    server.process.send_signal(signal.SIGCONT)


def kill_redis(server: RedisServer) -> None:
    """SIGKILL, as a crash: connections are reset, the data is gone."""
    server.process.kill()
    server.process.wait(timeout=10)


def restart_redis(server: OwnRedisServer) -> None:
    """Kill the server if it still runs and start an empty one on the same port."""
    if server.process.poll() is None:
        kill_redis(server)
    server.process = start_redis(server.port, server.workdir)


@dataclass
class RunningRedisCluster:
    """Three master nodes on loopback sharing the 16384 slots, no replicas."""

    processes: list[subprocess.Popen[bytes]]
    ports: list[int]

    @property
    def url(self) -> str:
        """A startup node for ``RedisCluster.from_url``; the client learns the others."""
        return self.node_url(0)

    def node_url(self, index: int) -> str:
        return f"redis://127.0.0.1:{self.ports[index]}/0"


@contextlib.contextmanager
def redis_cluster(workdir: Path, nodes: int = 3) -> Iterator[RunningRedisCluster]:
    """A private Redis Cluster, formed and with ``cluster_state:ok`` on every node."""
    import redis as redis_py

    ports: list[int] = []
    while len(ports) < 2 * nodes:  # a client port and a bus port per node, all distinct
        port = free_port()
        if port not in ports:
            ports.append(port)
    # The bus port is named: the default (port + 10000) may be taken, or past 65535.
    client_ports, bus_ports = ports[:nodes], ports[nodes:]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port, bus_port in zip(client_ports, bus_ports, strict=True):
            directory = workdir / f"node-{port}"
            directory.mkdir()
            options = [
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(bus_port),
                "--cluster-config-file",
                str(directory / "nodes.conf"),
            ]
            processes.append(start_redis(port, directory, *options))
        clients = [redis_py.Redis(host="127.0.0.1", port=p, socket_timeout=5) for p in client_ports]
        try:
            _form_cluster(clients, client_ports, bus_ports)
            for port, client in zip(client_ports, clients, strict=True):
                wait_for(functools.partial(_cluster_ok, client, nodes), what=f"node :{port}")
        finally:
            for client in clients:
                client.close()
        yield RunningRedisCluster(processes, client_ports)
    finally:
        for process in processes:
            stop_redis(process)


def _form_cluster(clients: list[Any], ports: list[int], bus_ports: list[int]) -> None:
    """What ``redis-cli --cluster create --cluster-replicas 0`` does: even slot ranges, a
    distinct config epoch per node, then the first node meets the others."""
    count = len(clients)
    for index, client in enumerate(clients):
        first, last = index * 16384 // count, (index + 1) * 16384 // count - 1
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
    for port, bus_port in zip(ports[1:], bus_ports[1:], strict=True):
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus_port)


def _cluster_ok(client: Any, nodes: int) -> bool:
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(nodes)


async def async_wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """``wait_for`` for a test's event loop: ``predicate`` may talk to servers, and the loop
    keeps running between polls (background writes, timers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def flush_redis(url: str) -> None:
    """Empty a test Redis (for tests that count or drop keys)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


async def command_calls(client: Any, command: str) -> int:
    """How many times Redis has run ``command`` (INFO commandstats)."""
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))
