"""`tailserve up` as a real process, for the tests of the whole stack."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from support.servers import WorkerProcess, free_port, wait_for
from tailserve.process.sessions import keep_priority

STARTED = re.compile(r"(worker-\d+) started \(pid (\d+)\) on (\S+)")
ANY_STARTED = re.compile(r"\S+ started \(pid (\d+)\) on")
# A free port may be taken by another test's process before the front door binds it, seconds
# after `up` started: `up` then exits saying so, and is started again on another port.
_TAKEN = "Address already in use"
_ATTEMPTS = 3
READY = re.compile(r"tailserve up: front door on .*, \d+ workers? ready")
FRONT_DOOR = re.compile(r"front door \(HAProxy pid (\d+)\) started")


class UpProcess(WorkerProcess):
    """`tailserve up` as a process: a worker process's handle, with the workers it started."""

    def worker_pids(self) -> dict[str, int]:
        """The newest pid of each worker, as the supervisor logged them."""
        return {name: int(pid) for name, pid, _ in STARTED.findall(self.log())}

    def worker_urls(self) -> set[str]:
        return {url for _, _, url in STARTED.findall(self.log())}

    def every_pid(self) -> list[int]:
        """Every process it started (the workers, the lane, the front door)."""
        return [int(pid) for pid in ANY_STARTED.findall(self.log())] + self.front_door_pids()

    def front_door_pids(self) -> list[int]:
        return [int(pid) for pid in FRONT_DOOR.findall(self.log())]


def alive(pid: int) -> bool:
    """Whether a process of that pid still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def tailserve_up(
    repository: Path,
    log_dir: Path,
    *extra: str,
    session: bool = False,
    shell: str = "",
    wait_ready: bool = True,
) -> Iterator[UpProcess]:
    """``tailserve up`` as a real process, once it says every worker is ready (``session``: in
    a process group of its own, as a shell's job; ``shell``: run by this bash script, which
    gets the command line as its arguments, as a wrapper script would run it)."""
    grpc = [] if "--grpc-port" in extra else ["--grpc-port", "0"]

    def start() -> tuple[subprocess.Popen[bytes], UpProcess]:
        port = free_port()
        log_path = log_dir / f"up-{port}.log"
        command = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "up",
            "--repository",
            str(repository),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *grpc,
            *extra,
        ]
        if shell:
            command = ["bash", "-c", shell, "bash", *command]
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=session
            )
        if session:
            keep_priority(process.pid)  # (a session of its own, at the priority of this one)
        return process, UpProcess(process, f"http://127.0.0.1:{port}", log_path)

    process, running = start()
    try:
        for attempt in range(_ATTEMPTS if wait_ready else 0):  # (else from the moment it starts)
            wait_for(
                lambda up=process, log=running.log: (
                    up.poll() is not None or READY.search(log()) is not None
                ),
                timeout=90,
                what="tailserve up to report its workers ready",
            )
            taken = process.poll() is not None and _TAKEN in running.log()
            if not taken or attempt == _ATTEMPTS - 1:
                break
            for pid in running.every_pid():  # (the one before has exited; what it started too)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            process, running = start()
        assert process.poll() is None, f"up exited with {process.returncode}:\n{running.log()}"
        yield running
    finally:
        if process.poll() is None:
            if session:  # the group: a wrapper's child, `tailserve up`, with it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.kill()  # its workers and HAProxy are in sessions of their own: them too
            process.wait(timeout=10)
            for pid in running.every_pid():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
