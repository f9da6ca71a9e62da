"""A job as the stores keep it, and the document a client reads back.

A job is one inference request run later: submitted (``queued``), taken by a worker
(``running``), then ``succeeded`` (its result kept for a while), ``failed`` (its error kept) or
``cancelled``. Times are the wall clock's (seconds since the epoch), so that any worker can
read another's; the stores take the clock as an argument, so expiry is tested with a fake one.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson

from tailserve.errors import InvalidInput


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset((JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED))


class RequestKind(enum.StrEnum):
    """The body a job was submitted with, which decides how its result is written."""

    OIP = "v2"  # an Open Inference Protocol request (JSON, or binary tensors)
    RECORDS = "v1"  # KServe v1 records: {"instances": [...]}


@dataclass(slots=True, kw_only=True)
class Job:
    id: str
    model: str
    version: str | None
    kind: RequestKind
    # The request body as it came (decompressed), and where its JSON header ends when it
    # carries binary tensors.
    request: bytes
    header_length: int | None = None
    priority: int = 1
    created_at: float
    status: JobStatus = JobStatus.QUEUED
    started_at: float | None = None
    finished_at: float | None = None
    # Times a worker took it: more than one when a worker died (or stalled) holding it.
    attempts: int = 0
    worker: str | None = None
    result: bytes | None = None  # the response, encoded as JSON
    error: str | None = None
    webhook: str | None = None
    webhook_attempts: int = 0
    webhook_delivered: bool | None = None  # None: not tried yet (or no webhook)
    webhook_error: str | None = None
    # Seconds the result is kept once the job has finished.
    result_ttl_s: float = 3600.0

    def document(self, *, with_result: bool = True) -> dict[str, Any]:
        """What `GET /v2/jobs/{id}` answers."""
        document: dict[str, Any] = {
            "id": self.id,
            "model": self.model,
            "version": self.version,
            "status": self.status.value,
            "priority": self.priority,
            "attempts": self.attempts,
            "worker": self.worker,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "timings": self.timings(),
        }
        if with_result and self.result is not None:
            # Kept encoded: embedded as it is, not parsed and written again.
            document["result"] = orjson.Fragment(self.result)
        if self.error is not None:
            document["error"] = self.error
        if self.webhook is not None:
            document["webhook"] = {
                "url": self.webhook,
                "attempts": self.webhook_attempts,
                "delivered": self.webhook_delivered,
                "error": self.webhook_error,
            }
        return document

    def timings(self) -> dict[str, float | None]:
        """Milliseconds queued, running, and in all (None: not reached yet)."""

        def ms(start: float | None, end: float | None) -> float | None:
            if start is None or end is None:
                return None
            return round((end - start) * 1e3, 3)

        return {
            "queued_ms": ms(self.created_at, self.started_at),
            "run_ms": ms(self.started_at, self.finished_at),
            "total_ms": ms(self.created_at, self.finished_at),
        }


@dataclass(frozen=True, slots=True)
class Lease:
    """A job a worker has taken: held until it finishes it, releases it, or stops touching it
    for longer than the visibility timeout (then another worker may take it)."""

    job: Job
    # The stream entry that queued it (Redis; the in-process store's own counter).
    entry: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobLimits:
    """One model's terms for jobs (`model.yaml`'s ``jobs:``, with the worker's defaults)."""

    # Jobs of the model waiting or running at once; beyond it a submission gets 429.
    max_queued: int = 10_000
    # 1 is the highest; a worker takes the jobs of the most urgent model first.
    priority: int = 1
    result_ttl_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class Listing:
    """A page of `GET /v2/jobs`: the jobs, newest first, and whether more matched."""

    jobs: list[Job] = field(default_factory=list)
    truncated: bool = False


_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def new_job_id(prefix: str = "") -> str:
    """A fresh job id: 128 random bits, after ``prefix`` and a dot when there is one (the name
    of the worker that holds it, for a front door to route by, when jobs are in-process)."""
    token = secrets.token_hex(16)
    return f"{prefix}.{token}" if prefix else token


def check_job_id(job_id: str) -> str:
    if not _ID.match(job_id):
        raise InvalidInput(
            f"{job_id[:64]!r} is not a job id (letters, digits, '.', '_' and '-', at most 128)"
        )
    return job_id


def id_prefix(worker_name: str) -> str:
    """The worker's name as a job id prefix: "" when it cannot be one (no front door could
    route by it then)."""
    return worker_name if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", worker_name) else ""


def parse_status(value: str) -> JobStatus:
    try:
        return JobStatus(value)
    except ValueError:
        names = ", ".join(s.value for s in JobStatus)
        raise InvalidInput(f"status must be one of {names}, got {value!r}") from None
