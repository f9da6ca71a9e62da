"""Polling the backends: a readiness check of each every ``health_interval_s``, and its model
index every few rounds (and whenever it comes back).

The answers go to the pure policies: each check to `ActiveHealth` (health.py), which takes a
backend out of service or brings it back; each index to the registry (upstreams.py), which
rebuilds the models' pools from it. After each round the outlier detector re-admits the
backends whose ejection has run out.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from tailserve.errors import UpstreamError
from tailserve.router.config import RouterConfig
from tailserve.router.health import ActiveHealth, OutlierDetector
from tailserve.router.upstreams import Upstream, Upstreams
from tailserve.transport import http1

log = logging.getLogger(__name__)

# The model index is read every this many health rounds (and when a backend comes back).
INDEX_EVERY = 5


class HealthPoller:
    def __init__(
        self,
        config: RouterConfig,
        upstreams: Upstreams,
        detector: OutlierDetector,
        *,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._config = config
        self._upstreams = upstreams
        self._detector = detector
        self._loop = loop
        self._health = ActiveHealth()
        self._round = 0
        self._stopped = False

    async def check_all(self) -> None:
        """One round of readiness checks (and, every few rounds, model indexes)."""
        index = self._round % INDEX_EVERY == 0
        self._round += 1
        upstreams = list(self._upstreams.values())
        await asyncio.gather(*(self._check(u, index) for u in upstreams))
        now = self._loop.time()
        for backend in self._detector.readmit(self._upstreams.everyone, now):
            log.info("re-admitted %s", backend.id)

    async def run(self) -> None:
        """A round every ``health_interval_s`` until `stop`."""
        while not self._stopped:
            await asyncio.sleep(self._config.health_interval_s)
            await self.check_all()

    def stop(self) -> None:
        self._stopped = True

    async def _check(self, upstream: Upstream, index: bool) -> None:
        timeout = max(0.2, self._config.health_interval_s)
        frame = http1.frame_request("GET", "/v2/health/ready", upstream.pool.origin)
        try:
            reply = await upstream.pool.request(frame, timeout)
            ready = reply.status == 200
        except UpstreamError:
            ready = False
        backend = upstream.backend
        if self._health.record(backend, ready):
            log.info("backend %s is %s", backend.id, "ready" if ready else "not ready")
            index = index or ready
            if ready:
                # Back (a restarted worker, say): what was known of its latency is old news.
                backend.reset_stats()
        if index and ready:
            await self._read_index(upstream, timeout)

    async def _read_index(self, upstream: Upstream, timeout_s: float) -> None:
        headers = []
        if self._config.admin_token:
            headers.append(("authorization", f"Bearer {self._config.admin_token}"))
        frame = http1.frame_request(
            "POST", "/v2/repository/index", upstream.pool.origin, b'{"ready":true}', headers
        )
        try:
            reply = await upstream.pool.request(frame, timeout_s)
            entries = orjson.loads(reply.body) if reply.status == 200 else None
        except (UpstreamError, orjson.JSONDecodeError):
            return
        if not isinstance(entries, list):
            return  # e.g. 401: no admin token given; it keeps serving every model
        models = frozenset(
            str(e["name"]) for e in entries if isinstance(e, dict) and e.get("state") == "READY"
        )
        self._upstreams.set_models(upstream, models)
