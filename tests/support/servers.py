"""Real servers on loopback for tests: a worker in a thread, a worker process, redis-server."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tailserve.loops import run
from tailserve.server import Worker
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
def run_worker(settings: Settings, *, wait_ready: bool = True) -> Iterator[RunningWorker]:
    """A worker on an unused loopback port, in a thread with its own event loop."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    worker = Worker(settings.replace(host="127.0.0.1", http_port=port))
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
    command = [sys.executable, "-m", "tailserve.cli", "serve", "--repository", str(repository),
               "--host", "127.0.0.1", "--http-port", str(port), *extra]  # fmt: skip
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
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(workdir)]  # fmt: skip
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
