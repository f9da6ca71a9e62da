"""Webhooks: a job's document POSTed to the URL its client gave, once the job has finished.

A delivery that fails (no connection, no answer in time, a 5xx, 408 or 429) is tried again
after a delay that doubles each time (with jitter, so the webhooks of a burst of jobs do not
come back in step), up to ``attempts`` tries; any other 4xx is the receiver's final word. How
it went is written back to the job (`JobStore.note_webhook`), for `GET /v2/jobs/{id}` to show.
Deliveries are kept in this worker's memory: a worker stopped while it retries one gives up.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tailserve.errors import InvalidInput, UpstreamError
from tailserve.transport.http1 import Pool, frame_request

log = logging.getLogger(__name__)

# Deliveries pending (waiting to be retried) at once; past it a job's webhook is dropped (logged).
MAX_PENDING = 10_000
_RETRY_STATUS = frozenset((408, 429))

# (job id, tries so far, delivered: True, False, or None while it is still being tried, error)
Outcome = Callable[[str, int, bool | None, str | None], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookPolicy:
    attempts: int = 6
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    timeout_s: float = 5.0
    jitter: float = 0.2  # each delay is drawn within this share of itself either side

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The wait after failed try number ``attempt`` (1 is the first)."""
        base = min(self.max_delay_s, self.first_delay_s * 2.0 ** (attempt - 1))
        return base * (1.0 + self.jitter * (2.0 * rng.random() - 1.0))


def check_url(url: str) -> str:
    """A webhook URL a worker can POST to (http or https, with a host), else `InvalidInput`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(f"webhook must be an http:// or https:// URL with a host, got {url!r}")
    try:
        parts.port  # noqa: B018  (reading it checks it)
    except ValueError:
        raise InvalidInput(f"webhook URL {url!r} has an invalid port") from None
    return url


class Webhooks:
    def __init__(
        self,
        policy: WebhookPolicy = WebhookPolicy(),
        *,
        on_outcome: Outcome,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self._on_outcome = on_outcome
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, url: str, job_id: str, body: bytes) -> None:
        if len(self._tasks) >= MAX_PENDING:
            log.warning("webhook for job %s dropped: %d deliveries pending", job_id, MAX_PENDING)
            return
        task = asyncio.create_task(self._deliver(url, job_id, body), name=f"webhook {job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, url: str, job_id: str, body: bytes) -> None:
        error: str | None = None
        attempt = 0
        for attempt in range(1, self.policy.attempts + 1):
            status, error = await self._post(url, body)
            if status is not None and 200 <= status < 300:
                await self._noted(job_id, attempt, True, None)
                return
            final = status is not None and 400 <= status < 500 and status not in _RETRY_STATUS
            if final or attempt == self.policy.attempts:
                break
            await self._noted(job_id, attempt, None, error)
            await self._sleep(self.policy.delay(attempt, self._rng))
        log.warning("webhook for job %s not delivered after %d tries: %s", job_id, attempt, error)
        await self._noted(job_id, attempt, False, error)

    async def _post(self, url: str, body: bytes) -> tuple[int | None, str | None]:
        """The receiver's status, and what went wrong (None: a 2xx)."""
        parts = urllib.parse.urlsplit(url)
        secure = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if secure else 80)
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        pool = Pool(
            host,
            port,
            max_connections=1,
            connect_timeout_s=self.policy.timeout_s,
            ssl=ssl.create_default_context() if secure else None,
        )
        headers = [("content-type", "application/json"), ("user-agent", "tailserve-webhook")]
        try:
            response = await pool.request(
                frame_request("POST", path, parts.netloc, body, headers), self.policy.timeout_s
            )
        except UpstreamError as exc:
            return None, exc.message
        except OSError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        finally:
            await pool.close()
        if 200 <= response.status < 300:
            return response.status, None
        return response.status, f"the receiver answered {response.status}"

    async def _noted(
        self, job_id: str, attempts: int, delivered: bool | None, error: str | None
    ) -> None:
        try:
            await self._on_outcome(job_id, attempts, delivered, error)
        except Exception:  # the store down: the delivery itself has happened (or not) anyway
            log.warning("could not note the webhook's outcome for job %s", job_id, exc_info=True)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
