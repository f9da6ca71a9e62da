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
from tailserve.observability.tracing import Tracing
from tailserve.process.loops import run
from tailserve.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# How long a wait for a server or a state gives up after, unless a test says: a guard against a
# hang, not a bound under test. `make test` runs most tests at idle priority beside the timing
# tests (tests/phases.py), and a saturating one leaves them no core for many seconds.
HANG_S = 90.0


def wait_for(
    predicate: Callable[[], bool], timeout: float = HANG_S, what: str = "condition"
) -> None:
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
    settings: Settings,
    *,
    wait_ready: bool = True,
    host: str = "127.0.0.1",
    tracing: Tracing | None = None,
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
    worker = Worker(
        settings.replace(host=host, http_port=port, grpc_port=grpc_port), tracing=tracing
    )
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
    """A Redis Cluster on loopback: masters sharing the 16384 slots, and their replicas."""

    processes: list[subprocess.Popen[bytes]]
    # Every node's client port: the masters first, then the replicas (as formed; a failover
    # swaps the roles, ``masters()`` says what they are now).
    ports: list[int]

    @property
    def url(self) -> str:
        """A startup node for ``RedisCluster.from_url``; the client learns the others."""
        return self.node_url(0)

    def node_url(self, index: int) -> str:
        return f"redis://127.0.0.1:{self.ports[index]}/0"

    def alive(self) -> list[int]:
        return [
            port for port, p in zip(self.ports, self.processes, strict=True) if p.poll() is None
        ]

    def nodes(self) -> list[ClusterNode]:
        """The cluster as a live node sees it (CLUSTER NODES)."""
        return _cluster_nodes(self.alive()[0])

    def masters(self) -> dict[int, ClusterNode]:
        """The masters that serve slots now, by port, as every live node sees them."""
        return {n.port: n for n in self.nodes() if n.master and n.slots and not n.failed}

    def owner(self, key: str | bytes) -> int:
        """The port of the master serving ``key``'s slot now."""
        from redis.crc import key_slot

        slot = key_slot(key.encode() if isinstance(key, str) else key)
        return next(port for port, n in self.masters().items() if n.serves(slot))

    def tag_on(self, port: int, *, elsewhere: bool = False) -> str:
        """A hash tag (``e<n>``) whose slot the master on ``port`` serves (or another does)."""
        from redis.crc import key_slot

        masters = self.masters()
        for n in range(10_000):
            tag = f"e{n}"
            owner = next(p for p, node in masters.items() if node.serves(key_slot(tag.encode())))
            if (owner == port) != elsewhere:
                return tag
        raise AssertionError(f"no tag on :{port}")

    def kill(self, port: int) -> None:
        """SIGKILL one node, as a crash."""
        process = self.processes[self.ports.index(port)]
        process.kill()
        process.wait(timeout=10)

    def wait_failed_over(self, port: int, timeout: float = 30.0) -> int:
        """Wait until a replica of the dead master on ``port`` serves its slots, as every live
        node sees it, with ``cluster_state:ok`` everywhere; the new master's port."""
        slots = next(n.slots for n in self.nodes() if n.port == port)
        promoted: list[int] = []

        def done() -> bool:
            owners = set()
            for alive in self.alive():
                view = _cluster_nodes(alive)
                owners.add(
                    frozenset(
                        n.port for n in view if n.master and not n.failed and n.slots == slots
                    )
                )
                with _client(alive) as client:
                    if not _cluster_ok(client, len(self.ports)):
                        return False
            (agreed,) = owners if len(owners) == 1 else (frozenset(),)
            if len(agreed) != 1 or port in agreed:
                return False
            promoted[:] = agreed
            return True

        wait_for(done, timeout=timeout, what=f"a replica to take over from :{port}")
        return promoted[0]


@dataclass(frozen=True)
class ClusterNode:
    """One line of CLUSTER NODES."""

    id: str
    port: int
    master: bool
    failed: bool  # flagged fail (or pfail, by the node asked)
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    def serves(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)


def _client(port: int) -> Any:
    import redis as redis_py

    return redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=5)


def _cluster_nodes(port: int) -> list[ClusterNode]:
    with _client(port) as client:
        raw = client.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        flags = set(fields[2].split(","))
        slots = []
        for part in fields[8:]:
            if part.startswith("["):  # a slot being migrated
                continue
            first, _, last = part.partition("-")
            slots.append((int(first), int(last or first)))
        nodes.append(
            ClusterNode(
                id=fields[0],
                port=int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                master="master" in flags,
                failed=bool(flags & {"fail", "fail?"}),
                master_id=None if fields[3] == "-" else fields[3],
                slots=tuple(sorted(slots)),
            )
        )
    return nodes


@contextlib.contextmanager
def redis_cluster(
    workdir: Path, nodes: int = 3, *, replicas: int = 0, node_timeout_ms: int | None = None
) -> Iterator[RunningRedisCluster]:
    """A private Redis Cluster of ``nodes`` masters with ``replicas`` replicas each (what
    ``redis-cli --cluster create --cluster-replicas N`` makes), formed, every replica in sync,
    and ``cluster_state:ok`` with every slot assigned on every node. Configured as
    deploy/kube/redis.py configures the real one; ``node_timeout_ms`` sets how soon a dead
    master's replica takes over."""
    import redis as redis_py

    count = nodes * (1 + replicas)
    ports: list[int] = []
    while len(ports) < 2 * count:  # a client port and a bus port per node, all distinct
        port = free_port()
        if port not in ports:
            ports.append(port)
    # The bus port is named: the default (port + 10000) may be taken, or past 65535.
    client_ports, bus_ports = ports[:count], ports[count:]
    timeout = [] if node_timeout_ms is None else ["--cluster-node-timeout", str(node_timeout_ms)]
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
                "--cluster-require-full-coverage",
                "no",
                "--cluster-replica-validity-factor",
                "0",
                # A replica's first sync starts at once, not after the diskless default's 5 s.
                "--repl-diskless-sync-delay",
                "0",
                *timeout,
            ]
            processes.append(start_redis(port, directory, *options))
        clients = [redis_py.Redis(host="127.0.0.1", port=p, socket_timeout=5) for p in client_ports]
        try:
            _form_cluster(clients[:nodes], client_ports, bus_ports)
            for port, client in zip(client_ports, clients, strict=True):
                wait_for(functools.partial(_knows_all, client, count), what=f"node :{port} to meet")
            for index, client in enumerate(clients[nodes:]):
                master = clients[index % nodes].execute_command("CLUSTER", "MYID")
                client.execute_command("CLUSTER", "REPLICATE", master)
            for port, client in zip(client_ports, clients, strict=True):
                wait_for(functools.partial(_cluster_ok, client, count), what=f"node :{port}")
            for port, client in zip(client_ports[nodes:], clients[nodes:], strict=True):
                wait_for(functools.partial(_in_sync, client), what=f"replica :{port} to sync")
        finally:
            for client in clients:
                client.close()
        yield RunningRedisCluster(processes, client_ports)
    finally:
        for process in processes:
            stop_redis(process)


def _form_cluster(masters: list[Any], ports: list[int], bus_ports: list[int]) -> None:
    """What ``redis-cli --cluster create`` does: even slot ranges over the masters, a distinct
    config epoch per master, then the first node meets every other."""
    count = len(masters)
    for index, client in enumerate(masters):
        first, last = index * 16384 // count, (index + 1) * 16384 // count - 1
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
    for port, bus_port in zip(ports[1:], bus_ports[1:], strict=True):
        masters[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus_port)


def _cluster_info(client: Any) -> dict[str, str]:
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def _knows_all(client: Any, nodes: int) -> bool:
    return _cluster_info(client).get("cluster_known_nodes") == str(nodes)


def _cluster_ok(client: Any, nodes: int) -> bool:
    # Every slot known to this node as well: with --cluster-require-full-coverage no, a node
    # says ok before it has heard which master holds each slot.
    fields = _cluster_info(client)
    return (
        fields.get("cluster_state") == "ok"
        and fields.get("cluster_known_nodes") == str(nodes)
        and fields.get("cluster_slots_assigned") == "16384"
    )


def _in_sync(client: Any) -> bool:
    info = client.info("replication")
    return info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")


async def async_wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = HANG_S, what: str = "condition"
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
