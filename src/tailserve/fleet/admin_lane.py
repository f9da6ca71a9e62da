"""The supervisor's admin lane: the fleet's own routes, which the front door sends here.

Off the inference path (HAProxy routes only these paths to it), on the worker's HTTP server:

- ``GET /metrics``: one Prometheus page for the whole stack: every worker's series with a
  ``worker`` label, the front door's (HAProxy's exporter) with ``worker="frontdoor"``, the
  hedging lane's (`router.router_metrics`) with ``worker="lane"``, and the supervisor's own
  (`fleet.fleet_metrics`: restarts, states, the autoscaler, reloads);
- ``GET /v2/fleet``: the workers (name, url, pid, state, restarts, cold start), the front
  door, and the autoscaler's last decision with its reason and inputs;
- ``POST /v2/cache/invalidate``: sent to every worker, so each one's in-process cache drops
  the entries with or without Redis (a worker that is down comes back with an empty cache);
- ``/v2/repository/...``: an index from one ready worker; a load or an unload on every
  worker, then the front door is told the models may have changed;
- ``GET /v2/jobs``, where jobs are kept in the workers' memory: every worker's list, merged
  newest first;
- ``GET /dashboard``: the live dashboard, fed by a sampler of the same pages once a second
  (`fleet.dashboard_lane`).

The admin token, where one is set, is checked by each worker: the lane passes the request's
``Authorization`` header on. Where the stack listens beyond loopback with no token, the lane
refuses the routes that change something (403), as a worker would
(`tailserve.transport.admin_access`).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from tailserve.errors import UpstreamError
from tailserve.fleet.dashboard_lane import Dashboard
from tailserve.fleet.fleet_metrics import fleet_families
from tailserve.transport.admin_access import CLOSED_MESSAGE, AdminAccess
from tailserve.transport.http1 import Pool, frame_request
from tailserve.transport.request import HttpRequest
from tailserve.transport.server import Headers, Reply

_JSON: Headers = [(b"content-type", b"application/json")]
FAN_OUT_TIMEOUT_S = 30.0
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Slot:
    """One worker as the lane sees it."""

    name: str
    host: str
    port: int
    pid: int | None
    ready: bool
    restarts: int
    running: bool
    # warming, standby, serving, draining, restarting or off (fleet.processes.ManagedWorker).
    state: str = ""
    cold_start_s: float | None = None


class Fleet(Protocol):
    def slots(self) -> list[Slot]: ...

    def front_door(self) -> dict[str, Any]: ...

    def autoscaler(self) -> dict[str, Any] | None: ...

    @property
    def stats_port(self) -> int: ...

    def models_changed(self) -> Coroutine[Any, Any, None]: ...

    def slos_s(self) -> dict[str, float]: ...


class AdminLane:
    """The `Application` the supervisor's HTTP server runs (transport.server)."""

    def __init__(self, fleet: Fleet, access: AdminAccess = AdminAccess.OPEN) -> None:
        self.fleet = fleet
        self.access = access
        self._pools: dict[tuple[str, int], Pool] = {}
        self.dashboard = Dashboard(self.pages, lambda: self._fleet()["workers"], fleet.slos_s)

    def start(self) -> None:
        """Start sampling for the dashboard (on the running loop)."""
        self.dashboard.start()

    def answer_now(self, request: HttpRequest) -> Reply | None:
        if request.error is not None:
            status, message = request.error
            return status, _JSON, orjson.dumps({"error": message})
        return None

    async def answer(self, request: HttpRequest) -> Reply:
        path, method = request.path, request.method
        if path == "/metrics" and method in ("GET", "HEAD"):
            return await self._metrics()
        if path == "/v2/fleet" and method in ("GET", "HEAD"):
            return 200, _JSON, orjson.dumps(self._fleet())
        if (dashboard := self.dashboard.answer(request)) is not None:
            return dashboard
        if path.startswith(("/v2/cache/", "/v2/repository/")) and self.access is AdminAccess.CLOSED:
            return 403, _JSON, orjson.dumps({"error": CLOSED_MESSAGE})
        if path == "/v2/cache/invalidate" and method == "POST":
            return await self._fan_out(request)
        if path == "/v2/repository/index" and method in ("GET", "POST"):
            return await self._one(request)
        if path == "/v2/jobs" and method == "GET":
            return await self._jobs(request)
        if path.startswith("/v2/repository/models/") and method == "POST":
            reply = await self._fan_out(request)
            if reply[0] == 200:
                await self.fleet.models_changed()
            return reply
        return 404, _JSON, orjson.dumps({"error": f"no route {method} {path}"})

    async def close(self) -> None:
        await self.dashboard.close()
        pools, self._pools = list(self._pools.values()), {}
        await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)

    # --- routes -----------------------------------------------------------------------------

    def _fleet(self) -> dict[str, Any]:
        workers = [
            {
                "name": s.name,
                "url": f"http://{s.host}:{s.port}",
                "pid": s.pid,
                "ready": s.ready,
                "restarts": s.restarts,
                "state": s.state or _state(s),
                "cold_start_s": s.cold_start_s,
            }
            for s in self.fleet.slots()
        ]
        return {
            "workers": workers,
            "front_door": self.fleet.front_door(),
            "autoscaler": self.fleet.autoscaler(),
        }

    async def _metrics(self) -> Reply:
        merged = merge_metrics(await self.pages(), own=fleet_families(self.fleet))
        return 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], merged

    async def pages(self) -> list[tuple[str, str]]:
        """The metrics pages (name, text) of the running workers, the front door and the
        hedging lane; those that did not answer are left out."""
        slots = [s for s in self.fleet.slots() if s.running]
        sources = [(s.name, s.host, s.port) for s in slots]
        if self.fleet.stats_port:
            sources.append(("frontdoor", "127.0.0.1", self.fleet.stats_port))
        lane = self.fleet.front_door().get("lane")
        if lane is not None and lane.get("url"):
            where = urllib.parse.urlsplit(lane["url"])
            sources.append(("lane", where.hostname or "127.0.0.1", where.port or 80))
        pages = await asyncio.gather(
            *(
                self._get(host, port, "/metrics", close=name == "frontdoor")
                for name, host, port in sources
            )
        )
        named = zip((name for name, _, _ in sources), pages, strict=True)
        return [(name, page) for name, page in named if page is not None]

    async def _fan_out(self, request: HttpRequest) -> Reply:
        """The request on every running worker; 200 when each one that runs took it."""
        body = request.raw_body
        headers = _passed_on(request)
        slots = [s for s in self.fleet.slots() if s.running]
        data = frame_request(request.method, request.path, "fleet", body, headers)
        results = await asyncio.gather(*(self._send(s, data) for s in slots))
        report: dict[str, Any] = {}
        worst = 200
        for slot, (status, payload) in zip(slots, results, strict=True):
            report[slot.name] = {"status": status, "reply": payload}
            if not 200 <= status < 300:
                worst = status if worst == 200 else worst
        for slot in self.fleet.slots():
            if not slot.running:  # it starts again with an empty in-process cache
                report[slot.name] = {"status": None, "reply": "not running"}
        if not slots:
            return 503, _JSON, orjson.dumps({"error": "no worker is running"})
        return worst, _JSON, orjson.dumps({"workers": report})

    async def _jobs(self, request: HttpRequest) -> Reply:
        """Each running worker's jobs (in-process, each holds its own), newest first, cut to
        the limit asked; an error a worker gives (a bad query) is the answer."""
        slots = [s for s in self.fleet.slots() if s.running]
        if not slots:
            return 503, _JSON, orjson.dumps({"error": "no worker is running"})
        data = frame_request("GET", request.target.decode("latin-1"), "fleet")
        results = await asyncio.gather(*(self._send(s, data) for s in slots))
        jobs: list[dict[str, Any]] = []
        truncated = False
        for status, payload in results:
            if status != 200 or not isinstance(payload, dict):
                if 400 <= status < 500:
                    return status, _JSON, orjson.dumps(payload)
                continue  # a worker not answering: its jobs are not listed
            jobs += payload.get("jobs", [])
            truncated = truncated or bool(payload.get("truncated"))
        jobs.sort(key=lambda job: job.get("created_at") or 0.0, reverse=True)
        limit = _limit(request)
        if len(jobs) > limit:
            jobs, truncated = jobs[:limit], True
        return 200, _JSON, orjson.dumps({"jobs": jobs, "truncated": truncated})

    async def _one(self, request: HttpRequest) -> Reply:
        ready = [s for s in self.fleet.slots() if s.ready] or [
            s for s in self.fleet.slots() if s.running
        ]
        if not ready:
            return 503, _JSON, orjson.dumps({"error": "no worker is running"})
        data = frame_request(
            request.method, request.path, "fleet", request.raw_body, _passed_on(request)
        )
        status, payload = await self._send(ready[0], data)
        return status, _JSON, orjson.dumps(payload)

    # --- I/O ----------------------------------------------------------------------------------

    def _pool(self, host: str, port: int) -> Pool:
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[host, port] = Pool(host, port, max_connections=4)
        return pool

    async def _send(self, slot: Slot, data: bytes) -> tuple[int, Any]:
        try:
            reply = await self._pool(slot.host, slot.port).request(data, FAN_OUT_TIMEOUT_S)
        except UpstreamError as exc:
            return 502, f"{slot.name} did not answer: {exc}"
        try:
            payload: Any = orjson.loads(reply.body) if reply.body else None
        except orjson.JSONDecodeError:
            payload = reply.body.decode(errors="replace")
        return reply.status, payload

    async def _get(self, host: str, port: int, path: str, *, close: bool = False) -> str | None:
        """``close``: ask for the connection to close after the reply (HAProxy's own: a
        draining HAProxy keeps an idle client connection open until its next request)."""
        headers = [("connection", "close")] if close else []
        data = frame_request("GET", path, f"{host}:{port}", headers=headers)
        with contextlib.suppress(UpstreamError):
            reply = await self._pool(host, port).request(data, SCRAPE_TIMEOUT_S)
            if reply.status == 200:
                return reply.body.decode("utf-8", errors="replace")
        return None


def merge_metrics(pages: Iterable[tuple[str, str]], own: Iterable[Metric] = ()) -> bytes:
    """Prometheus text pages (source name, page) as one page, each sample labelled with its
    ``worker``; a family's HELP and TYPE come from the first page that has it. ``own``: the
    page-maker's own families, as they are."""
    families: dict[str, Metric] = {family.name: family for family in own}
    for source, page in pages:
        for family in text_string_to_metric_families(page):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, "worker": source}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(list(families.values())))
    return generate_latest(registry)


class _Static:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _limit(request: HttpRequest) -> int:
    """The listing's ``limit`` (each worker has checked it), else the workers' default."""
    query = urllib.parse.parse_qs(request.target.partition(b"?")[2].decode("latin-1"))
    try:
        return int(query.get("limit", ["100"])[0])
    except ValueError:
        return 100


def _passed_on(request: HttpRequest) -> list[tuple[str, str]]:
    out = []
    for name in (b"authorization", b"content-type", b"content-encoding"):
        value = request.header(name)
        if value is not None:
            out.append((name.decode(), value.decode("latin-1")))
    return out


def _state(slot: Slot) -> str:
    if not slot.running:
        return "restarting"
    return "ready" if slot.ready else "starting"
