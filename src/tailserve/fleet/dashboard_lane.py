"""The dashboard's routes on the admin lane, and the sampler that feeds them.

Once a second the sampler reads every worker's ``/metrics`` (the same pages the lane merges
for the stack's ``/metrics``) and the fleet's workers, and adds a point to a ring of the last
ten minutes (`dashboard_series.History`). The page polls ``/dashboard/series`` for the points
it has not seen, so any number of open pages cost the workers nothing more than that one
scrape a second.

- ``GET /dashboard``: the page (``fleet/dashboard/index.html``), with its script and style
  at ``/dashboard/dashboard.js`` and ``/dashboard/dashboard.css``, shipped in the package;
- ``GET /dashboard/series?since=SEQ``: the points after ``SEQ`` (0 or none: all kept), the
  workers now and the sampling interval, as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from typing import Any

import orjson

from tailserve.fleet.dashboard_series import History, parse_pages
from tailserve.transport.request import HttpRequest
from tailserve.transport.server import Headers, Reply

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
KEEP_S = 600.0
ASSETS = {
    "index.html": b"text/html; charset=utf-8",
    "dashboard.js": b"text/javascript; charset=utf-8",
    "dashboard.css": b"text/css; charset=utf-8",
}
_JSON: Headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]

Pages = Callable[[], Awaitable[list[tuple[str, str]]]]
Workers = Callable[[], list[dict[str, Any]]]


class Dashboard:
    """``pages``: the running workers' metrics pages (name, text); ``workers``: the fleet's
    workers as ``/v2/fleet`` lists them; ``slos_s``: each model's SLO from its config."""

    def __init__(
        self,
        pages: Pages,
        workers: Workers,
        slos_s: Callable[[], Mapping[str, float]],
        *,
        interval_s: float = INTERVAL_S,
        keep_s: float = KEEP_S,
    ) -> None:
        self.interval_s = interval_s
        self.history = History(keep=max(1, round(keep_s / interval_s)))
        self._pages = pages
        self._workers = workers
        self._slos_s = slos_s
        self._assets = {name: _asset(name) for name in ASSETS}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dashboard sampler")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def answer(self, request: HttpRequest) -> Reply | None:
        """The reply to a dashboard route; None for any other path."""
        path = request.path
        if path != "/dashboard" and not path.startswith("/dashboard/"):
            return None
        if request.method not in ("GET", "HEAD"):
            return 405, _JSON, orjson.dumps({"error": f"{path} answers GET only"})
        if path in ("/dashboard", "/dashboard/"):
            path = "/dashboard/index.html"
        if path == "/dashboard/series":
            return self._series(request)
        name = path.removeprefix("/dashboard/")
        if name not in self._assets:
            return 404, _JSON, orjson.dumps({"error": f"no dashboard file {name!r}"})
        headers = [(b"content-type", ASSETS[name]), (b"cache-control", b"no-cache")]
        return 200, headers, self._assets[name]

    async def sample(self) -> None:
        """One point, now."""
        pages = await self._pages()
        workers = self._workers()
        states: dict[str, int] = {}
        for worker in workers:
            states[worker["state"]] = states.get(worker["state"], 0) + 1
        samples = parse_pages(pages)
        self.history.add(time.time(), time.monotonic(), samples, states, self._slos_s())

    # --- internals ----------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                await self.sample()
            except Exception:  # a bad page must not end the dashboard: said, then on
                log.exception("dashboard sample failed")
            # On a fixed schedule: a slow scrape shortens the wait, it does not shift the rest.
            due = max(due + self.interval_s, loop.time())
            await asyncio.sleep(due - loop.time())

    def _series(self, request: HttpRequest) -> Reply:
        query = urllib.parse.parse_qs(request.target.partition(b"?")[2].decode("latin-1"))
        since = query.get("since", ["0"])[0]
        try:
            seq = int(since)
        except ValueError:
            seq = -1
        if seq < 0:
            message = f"since must be a point's number (a whole number, 0 or more), not {since!r}"
            return 400, _JSON, orjson.dumps({"error": message[:200]})
        document = {
            "interval_s": self.interval_s,
            "latest": self.history.latest,
            "points": self.history.since(seq),
            "workers": self._workers(),
        }
        return 200, _JSON, orjson.dumps(document, option=orjson.OPT_NON_STR_KEYS)


def _asset(name: str) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        return (resources.files("tailserve.fleet") / "dashboard" / name).read_bytes()
    raise RuntimeError(f"the dashboard's {name} is missing from the package (reinstall it)")
