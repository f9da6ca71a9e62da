"""Where jobs wait, run and keep their results: the interface, and its in-process twin.

`MemoryJobStore` is the embedded default (no Redis): one worker's memory, lost when the worker
stops, each worker holding the jobs submitted to it (a front door routes a job's id back to
its worker by the id's prefix). `redis_store.RedisJobStore` is the durable one, shared by
every worker. Both keep the same promises, and the same tests run against both:

- a submission beyond a model's bound of waiting and running jobs is refused (`QueueFull`);
- a worker takes the jobs of the most urgent model first (the caller lists the models in that
  order), each job at the head of its model's queue;
- a job a worker holds and stops touching for the visibility timeout goes back to the head of
  its queue, for any worker to take again: execution at least once;
- the first result written wins; a later one (from a worker thought dead) is dropped, and so
  is one for a job cancelled meanwhile: one visible result per job;
- a finished job is kept ``result_ttl_s``, then forgotten.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import heapq
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from tailserve.errors import QueueFull
from tailserve.jobs.records import Job, JobStatus, Lease, Listing

# The most jobs one listing reads before it stops looking for matches.
LIST_SCAN = 10_000


class JobStore(Protocol):
    # Whether jobs outlive the worker (and any worker may take any job).
    durable: bool

    async def submit(self, job: Job, *, max_queued: int) -> None:
        """Queue ``job``; `QueueFull` when its model has ``max_queued`` jobs waiting or
        running."""

    async def get(self, job_id: str) -> Job | None: ...

    async def cancel(self, job_id: str) -> Job | None:
        """Cancel a job that has not finished; the job as it now stands (None: unknown)."""

    async def list(self, *, model: str | None, status: JobStatus | None, limit: int) -> Listing:
        """The newest jobs, filtered."""

    async def take(
        self, models: Sequence[str], worker: str, count: int, wait_s: float
    ) -> builtins.list[Lease]:
        """Up to ``count`` jobs of ``models`` (the first listed first), now running on
        ``worker``; waits up to ``wait_s`` for one when none is queued."""

    async def touch(self, lease: Lease) -> JobStatus | None:
        """Renew the worker's hold on a job; the job's status (cancelled: stop; None: gone)."""

    async def finish(
        self, lease: Lease, *, result: bytes | None = None, error: str | None = None
    ) -> Job | None:
        """Write the job's outcome; the job, or None when the outcome was dropped (another
        worker's came first, or the job was cancelled or has expired)."""

    async def release(self, lease: Lease) -> None:
        """Put a job back at the head of its queue (a worker stopping, a model unloading)."""

    async def note_webhook(
        self, job_id: str, *, attempts: int, delivered: bool | None, error: str | None
    ) -> None:
        """Record how the job's webhook went."""

    async def close(self) -> None: ...


class MemoryJobStore:
    """The in-process store (see the module's docstring). ``clock``: the wall clock."""

    durable = False

    def __init__(
        self, *, clock: Callable[[], float] = time.time, visibility_timeout_s: float = 30.0
    ) -> None:
        self._clock = clock
        self._visibility_s = visibility_timeout_s
        self._jobs: dict[str, Job] = {}  # in the order they came
        self._queues: dict[str, deque[str]] = {}
        self._unfinished: Counter[str] = Counter()
        self._held: dict[str, float] = {}  # running job -> when its hold lapses
        self._expiry: list[tuple[float, str]] = []  # (when, finished job)
        self._arrived = asyncio.Event()

    async def submit(self, job: Job, *, max_queued: int) -> None:
        self._purge()
        waiting = self._unfinished[job.model]
        if waiting >= max_queued:
            raise QueueFull(
                f"model {job.model!r} has {waiting} jobs waiting or running, its bound: "
                "try again later",
                retry_after_s=1.0,
            )
        self._jobs[job.id] = replace(job)
        self._queues.setdefault(job.model, deque()).append(job.id)
        self._unfinished[job.model] += 1
        self._arrived.set()

    async def get(self, job_id: str) -> Job | None:
        self._purge()
        job = self._jobs.get(job_id)
        return replace(job) if job is not None else None

    async def cancel(self, job_id: str) -> Job | None:
        self._purge()
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if not job.status.finished:
            # A queued one is skipped when its turn comes; a running one's result is dropped.
            self._finished(job, JobStatus.CANCELLED)
        return replace(job)

    async def list(self, *, model: str | None, status: JobStatus | None, limit: int) -> Listing:
        self._purge()
        found: list[Job] = []
        for scanned, job_id in enumerate(reversed(self._jobs)):
            if scanned >= LIST_SCAN:
                return Listing(found, truncated=True)
            job = self._jobs[job_id]
            if (model is None or job.model == model) and (status is None or job.status == status):
                if len(found) == limit:
                    return Listing(found, truncated=True)
                found.append(replace(job, request=b"", result=None))
        return Listing(found)

    async def take(
        self, models: Sequence[str], worker: str, count: int, wait_s: float
    ) -> builtins.list[Lease]:
        taken = self._take(models, worker, count)
        if taken or wait_s <= 0:
            return taken
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), wait_s)
        return self._take(models, worker, count)

    def _take(self, models: Sequence[str], worker: str, count: int) -> builtins.list[Lease]:
        self._purge()
        self._lapse()
        taken: builtins.list[Lease] = []
        now = self._clock()
        for model in models:
            queue = self._queues.get(model)
            while queue and len(taken) < count:
                job = self._jobs.get(queue.popleft())
                if job is None or job.status.finished:
                    continue
                job.status = JobStatus.RUNNING
                if job.started_at is None:
                    job.started_at = now
                job.attempts += 1
                job.worker = worker
                self._held[job.id] = now + self._visibility_s
                taken.append(Lease(replace(job), str(job.attempts)))
        return taken

    def _lapse(self) -> None:
        """Jobs whose hold has lapsed go back to the head of their queues."""
        now = self._clock()
        for job_id, until in list(self._held.items()):
            if until <= now:
                del self._held[job_id]
                job = self._jobs.get(job_id)
                if job is not None and not job.status.finished:
                    self._queues.setdefault(job.model, deque()).appendleft(job_id)

    async def touch(self, lease: Lease) -> JobStatus | None:
        job = self._jobs.get(lease.job.id)
        if job is None:
            return None
        if job.status is JobStatus.RUNNING and job.worker == lease.job.worker:
            self._held[job.id] = self._clock() + self._visibility_s
        return job.status

    async def finish(
        self, lease: Lease, *, result: bytes | None = None, error: str | None = None
    ) -> Job | None:
        self._purge()
        job = self._jobs.get(lease.job.id)
        if job is None or job.status is not JobStatus.RUNNING:
            return None  # finished already, cancelled, or put back in its queue meanwhile
        job.result, job.error = result, error
        self._finished(job, JobStatus.FAILED if error is not None else JobStatus.SUCCEEDED)
        return replace(job)

    async def release(self, lease: Lease) -> None:
        job = self._jobs.get(lease.job.id)
        if job is None or job.status is not JobStatus.RUNNING or job.worker != lease.job.worker:
            return  # not this lease's to give back (its hold lapsed; another runs it)
        self._held.pop(job.id, None)
        job.status, job.worker = JobStatus.QUEUED, None
        self._queues.setdefault(job.model, deque()).appendleft(job.id)
        self._arrived.set()

    async def note_webhook(
        self, job_id: str, *, attempts: int, delivered: bool | None, error: str | None
    ) -> None:
        job = self._jobs.get(job_id)
        if job is not None:
            job.webhook_attempts, job.webhook_delivered = attempts, delivered
            job.webhook_error = error

    async def close(self) -> None:
        self._arrived.set()

    def _finished(self, job: Job, status: JobStatus) -> None:
        now = self._clock()
        job.status, job.finished_at = status, now
        self._held.pop(job.id, None)
        self._unfinished[job.model] -= 1
        heapq.heappush(self._expiry, (now + job.result_ttl_s, job.id))

    def _purge(self) -> None:
        """Forget the finished jobs whose time is up."""
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, job_id = heapq.heappop(self._expiry)
            self._jobs.pop(job_id, None)
