"""Where the router's backends come from: the command line, a watched file, a DNS name.

The file holds one backend URL a line (``http://10.0.0.5:8000`` or ``10.0.0.5:8000``; blank
lines and ``#`` comments are skipped); it is read again whenever its modification time or
size changes, so a deployment tool rewrites it to add or remove workers. A DNS name
(``HOST:PORT``) is resolved every ``dns_interval_s``: each address it resolves to is a
backend on that port, which is how a Kubernetes headless Service presents its pods. The
members are the union of the three. A name that stops resolving, or a file that cannot be
read, keeps the last good answer rather than emptying the pool on a transient error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

from tailserve.errors import ConfigError
from tailserve.router.config import RouterConfig, backend_url, parse_backend, parse_host_port

log = logging.getLogger(__name__)


def parse_members(text: str, *, source: str = "backends file") -> tuple[list[str], list[str]]:
    """The backend URLs of a file's text, and a message for each line that is not one."""
    urls: list[str] = []
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host, port = parse_backend(line)
        except ConfigError as exc:
            problems.append(f"{source} line {number}: {exc.message}")
            continue
        urls.append(backend_url(host, port))
    return urls, problems


class Membership:
    def __init__(
        self,
        config: RouterConfig,
        apply: Callable[[list[str]], None],
        *,
        resolve: Callable[[str, int], Iterable[str]] | None = None,
    ) -> None:
        self._config = config
        self._apply = apply
        self._static = [backend_url(*parse_backend(url)) for url in config.backends]
        self._from_file: list[str] = []
        self._from_dns: list[str] = []
        self._file_stamp: tuple[float, int] | None = None
        self._resolve = resolve
        self._last: list[str] | None = None

    @property
    def members(self) -> list[str]:
        return list(dict.fromkeys([*self._static, *self._from_file, *self._from_dns]))

    async def refresh(self) -> list[str]:
        """Read every source once, apply the members if they changed; answer them."""
        self._read_file()
        await self._read_dns()
        members = self.members
        if members != self._last:
            self._last = members
            self._apply(members)
        return members

    async def run(self) -> None:
        """Re-read the file and re-resolve the name, each at its own interval."""
        tasks = []
        if self._config.backends_file:
            tasks.append(self._every(self._config.file_interval_s, self._read_file_async))
        if self._config.backends_dns:
            tasks.append(self._every(self._config.dns_interval_s, self._read_dns))
        if tasks:
            await asyncio.gather(*tasks)

    async def _every(self, interval_s: float, read: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            result = read()
            if asyncio.iscoroutine(result):
                await result
            members = self.members
            if members != self._last:
                self._last = members
                self._apply(members)

    async def _read_file_async(self) -> None:
        self._read_file()

    def _read_file(self) -> None:
        name = self._config.backends_file
        if not name:
            return
        path = Path(name)
        try:
            stat = path.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp == self._file_stamp:
                return
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            if self._file_stamp is not None:
                log.warning("cannot read %s (keeping its last backends): %s", path, exc)
                self._file_stamp = None
            return
        self._file_stamp = stamp
        urls, problems = parse_members(text, source=str(path))
        for problem in problems:
            log.warning("%s", problem)
        self._from_file = urls

    async def _read_dns(self) -> None:
        name = self._config.backends_dns
        if not name:
            return
        host, port = parse_host_port(name, "--backends-dns")
        try:
            if self._resolve is not None:
                addresses = list(self._resolve(host, port))
            else:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
                addresses = [str(info[4][0]) for info in infos]
        except OSError as exc:
            log.warning("cannot resolve %s (keeping its last backends): %s", name, exc)
            return
        self._from_dns = sorted({backend_url(a, port) for a in addresses})


def write_members(path: os.PathLike[str] | str, urls: Iterable[str]) -> None:
    """Replace a backends file at once (write, then rename), so a reader never sees half."""
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text("".join(f"{url}\n" for url in urls), encoding="utf-8")
    temporary.replace(target)
