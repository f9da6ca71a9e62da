"""The jobs API behind the HTTP routes: submit, read, cancel and list, as documents.

A submission is read and checked as an inference request would be (the model, the body, each
input's values) before it is queued, so a bad one gets its 400 at once instead of a failed job
later. The job keeps the body as it came; the worker that runs it reads it again
(`runner.JobRunner`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from tailserve.engine.dataplane import DataPlane
from tailserve.engine.messages import InferRequest
from tailserve.errors import Conflict, InvalidInput, JobNotFound, QueueFull
from tailserve.jobs.records import (
    Job,
    JobStatus,
    RequestKind,
    check_job_id,
    new_job_id,
    parse_status,
)
from tailserve.jobs.store import JobStore
from tailserve.jobs.webhook import check_url
from tailserve.protocols.http import kserve_v1, oip

# The longest a submission is held for room before it is refused, and how often it looks.
SUBMIT_WAIT_S = 10.0
_ROOM_POLL_S = 0.02
# `GET /v2/jobs` answers at most this many jobs at once.
MAX_LIST = 1000
DEFAULT_LIST = 100


def decode(
    dataplane: DataPlane,
    kind: RequestKind,
    model: str,
    version: str | None,
    body: bytes,
    header_length: int | None,
) -> InferRequest:
    """A job's body as the inference request it holds."""
    if kind is RequestKind.RECORDS:
        config = dataplane.manager.get(model, version).config
        request = kserve_v1.decode_records(model, config, body)
        request.version = version
        return request
    return oip.decode_request(model, version, body, header_length)


class JobDesk:
    def __init__(
        self,
        store: JobStore,
        dataplane: DataPlane,
        *,
        id_prefix: str = "",
        clock: Callable[[], float] = time.time,
        pressed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store = store
        self._pressed = pressed
        self._dataplane = dataplane
        self._prefix = id_prefix
        self._clock = clock

    async def submit(
        self,
        *,
        model: str,
        version: str | None,
        kind: str,
        body: bytes,
        header_length: int | None = None,
        webhook: str | None = None,
    ) -> dict[str, Any]:
        served = self._dataplane.model(model, version)
        config = served.config
        if not config.jobs.enabled:
            raise InvalidInput(f"model {model!r} takes no jobs (jobs.enabled is false)")
        await self._room()
        request_kind = RequestKind(kind)
        request = decode(self._dataplane, request_kind, model, version, body, header_length)
        if served.features is None:  # (inputs from the feature store are checked when run)
            served.plan.check(request.inputs, max_rows=config.jobs.max_rows)
        if webhook is None:
            named = request.parameters.get("webhook")
            if named is not None and not isinstance(named, str):
                raise InvalidInput(f"parameter 'webhook' must be a URL, got {named!r}")
            webhook = named
        job = Job(
            id=new_job_id(self._prefix),
            model=model,
            version=version,
            kind=request_kind,
            request=body,
            header_length=header_length,
            priority=config.jobs.priority,
            created_at=self._clock(),
            webhook=check_url(webhook) if webhook is not None else None,
            result_ttl_s=config.jobs.result_ttl_s,
        )
        await self.store.submit(job, max_queued=config.jobs.max_queued)
        return job.document()

    async def _room(self) -> None:
        """Hold a submission while the worker's online requests need all its time (the
        client, or the front door's queue, waits: a refusal would only come back); 429
        after `SUBMIT_WAIT_S`."""
        waited = 0.0
        while self._pressed():
            if waited >= SUBMIT_WAIT_S:
                raise QueueFull(
                    "this worker's online requests need all its time now: submit the job "
                    "again after the Retry-After",
                    retry_after_s=1.0,
                )
            await asyncio.sleep(_ROOM_POLL_S)
            waited += _ROOM_POLL_S

    async def get(self, job_id: str) -> dict[str, Any]:
        return (await self._job(job_id)).document()

    async def cancel(self, job_id: str) -> dict[str, Any]:
        job = await self.store.cancel(check_job_id(job_id))
        if job is None:
            raise JobNotFound(f"no job {job_id!r} (never submitted, or its result has expired)")
        if job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
            raise Conflict(f"job {job_id!r} has already {job.status.value}: nothing to cancel")
        return job.document()

    async def listing(
        self, *, model: str | None, status: str | None, limit: str | None
    ) -> dict[str, Any]:
        count = DEFAULT_LIST
        if limit is not None:
            try:
                count = int(limit)
            except ValueError:
                count = 0
            if not 1 <= count <= MAX_LIST:
                raise InvalidInput(f"limit must be a whole number in 1..{MAX_LIST}, got {limit!r}")
        chosen = parse_status(status) if status is not None else None
        found = await self.store.list(model=model, status=chosen, limit=count)
        return {
            "jobs": [job.document(with_result=False) for job in found.jobs],
            "truncated": found.truncated,
        }

    async def _job(self, job_id: str) -> Job:
        job = await self.store.get(check_job_id(job_id))
        if job is None:
            raise JobNotFound(f"no job {job_id!r} (never submitted, or its result has expired)")
        return job
