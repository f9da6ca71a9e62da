"""The job runner of one worker: takes jobs from the store and runs them in the background lane.

It holds at most ``concurrency`` jobs at once, fewer while online requests need the event loop
(`pacing.Pacer`), taking the jobs of the most urgent models first (`jobs.priority`), and only
while the worker is ready. Each job is
inferred through `DataPlane.infer_job`: the model's background lane, which runs only in the
time online requests leave free. While it runs, its hold in the store is renewed, and a
cancellation seen there stops it.

Outcomes: a result (succeeded); an error that running it again would repeat, such as a bad
input or a model that fails on it (failed); one that may pass (the model unloading, the
worker stopping): the job goes back to its queue, for this worker or another, up to
``max_attempts`` tries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import orjson

from tailserve.engine.dataplane import DataPlane
from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import TailserveError, Unavailable
from tailserve.jobs.desk import decode
from tailserve.jobs.pacing import Pacer, PacingConfig
from tailserve.jobs.records import Job, JobStatus, Lease, RequestKind
from tailserve.jobs.store import JobStore
from tailserve.jobs.webhook import Webhooks
from tailserve.protocols.http import kserve_v1, oip

log = logging.getLogger(__name__)

# Online traffic seen this recently still has the pacer keep room for it.
ONLINE_MEMORY_S = 2.0


class JobObserver(Protocol):
    def on_job(self, model: str, outcome: str, seconds: float | None) -> None:
        """A job ended here: succeeded or failed (``seconds`` since it was submitted), or
        released (None)."""


class LoopState(Protocol):
    lag_s: float  # how late the event loop runs what is ready (moving average)
    busy: float  # how busy its thread is, 0..1


class _Idle:
    lag_s = 0.0
    busy = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerConfig:
    # The most jobs held at once (the pacer holds fewer while online requests need the loop).
    concurrency: int = 4
    # How long one take waits for a job when none is queued.
    poll_s: float = 1.0
    # The hold on a running job is renewed this often (well within the visibility timeout).
    touch_interval_s: float = 1.0
    max_attempts: int = 5


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        dataplane: DataPlane,
        *,
        worker: str,
        config: RunnerConfig = RunnerConfig(),
        webhooks: Webhooks | None = None,
        loop: LoopState | None = None,
        observer: JobObserver | None = None,
        pacing: PacingConfig | None = None,
    ) -> None:
        self._store = store
        self._observer = observer
        self._dataplane = dataplane
        self._worker = worker
        self.config = config
        self._webhooks = webhooks
        self._loop: LoopState = loop or _Idle()
        self.pacer = Pacer(pacing or PacingConfig(max_jobs=config.concurrency))
        self._online_count = 0
        self._online_at = -ONLINE_MEMORY_S
        self._running: dict[asyncio.Task[None], Lease] = {}
        self._main: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def running(self) -> int:
        return len(self._running)

    def pressed(self) -> bool:
        """Whether the event loop has no room for job work now (a submission waits)."""
        loop = self._loop
        return self.pacer.pressing(lag_s=loop.lag_s, busy=loop.busy, online=self._online())

    def _online(self) -> bool:
        """Whether online requests came in the last `ONLINE_MEMORY_S`."""
        now, count = time.monotonic(), self._dataplane.online_requests
        if count != self._online_count:
            self._online_count, self._online_at = count, now
        return now - self._online_at < ONLINE_MEMORY_S

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name="job-runner")

    async def close(self) -> None:
        """Stop taking jobs; the jobs held go back to their queues (the worker is stopping)."""
        self._stopping.set()
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        if self._main is not None:
            self._main.cancel()
            await asyncio.gather(self._main, return_exceptions=True)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._webhooks is not None:
            await self._webhooks.close()

    def models(self) -> list[str]:
        """The ready models that take jobs, the most urgent first."""
        ready = []
        for state in self._dataplane.manager.states():
            if not state.ready or not state.versions:
                continue
            latest = state.versions[max(state.versions)]
            if latest.config.jobs.enabled:
                ready.append((latest.config.jobs.priority, state.name))
        return [name for _, name in sorted(ready)]

    async def _run(self) -> None:
        loop = self._loop
        while not self._stopping.is_set():
            limit = self.pacer.update(
                time.monotonic(), lag_s=loop.lag_s, busy=loop.busy, online=self._online()
            )
            free = limit - len(self._running)
            models = self.models() if self._dataplane.ready() else []
            if free <= 0 or not models:
                await self._pause()
                continue
            try:
                leases = await self._store.take(models, self._worker, free, self.config.poll_s)
            except Unavailable as exc:
                log.warning("cannot take jobs: %s", exc.message)
                await self._pause(1.0)
                continue
            for lease in leases:
                task = asyncio.create_task(self._execute(lease), name=f"job {lease.job.id}")
                self._running[task] = lease
                task.add_done_callback(self._running.pop)

    async def _pause(self, seconds: float = 0.05) -> None:
        """Until a held job ends, or ``seconds`` pass."""
        waiting = [*self._running, asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait(waiting, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting[-1].cancel()

    async def _execute(self, lease: Lease) -> None:
        job = lease.job
        work = asyncio.create_task(self._infer(job))
        keeper = asyncio.create_task(self._keep(lease, work))
        result: bytes | None = None
        error: str | None = None
        try:
            result = await work
        except asyncio.CancelledError:
            if self._stopping.is_set():
                await self._release(lease)
                raise
            return  # cancelled in the store (`_keep` saw it): nothing to write
        except Unavailable as exc:
            if job.attempts < self.config.max_attempts:
                log.info("job %s: %s; queued again", job.id, exc.message)
                await self._release(lease)
                return
            error = exc.message
        except TailserveError as exc:
            error = exc.message
        except Exception as exc:
            log.exception("job %s failed", job.id)
            error = f"internal error: {type(exc).__name__}"
        finally:
            keeper.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(keeper, work, return_exceptions=True)
        await self._finish(lease, result, error)

    async def _finish(self, lease: Lease, result: bytes | None, error: str | None) -> None:
        try:
            finished = await self._store.finish(lease, result=result, error=error)
        except Unavailable as exc:
            # Not written: the hold lapses and another try writes it (at least once).
            log.warning("job %s: its outcome could not be written: %s", lease.job.id, exc.message)
            return
        if finished is None:
            return  # cancelled meanwhile, or another worker's outcome came first
        if self._observer is not None:
            seconds = (finished.finished_at or finished.created_at) - finished.created_at
            outcome = "succeeded" if error is None else "failed"
            self._observer.on_job(finished.model, outcome, seconds)
        if finished.webhook is not None and self._webhooks is not None:
            body = orjson.dumps(finished.document())
            self._webhooks.send(finished.webhook, finished.id, body)

    async def _release(self, lease: Lease) -> None:
        if self._observer is not None:
            self._observer.on_job(lease.job.model, "released", None)
        with contextlib.suppress(TailserveError):
            await asyncio.shield(self._store.release(lease))

    async def _keep(self, lease: Lease, work: asyncio.Task[bytes]) -> None:
        """Renew the hold on a running job; stop its work when the store says it was
        cancelled (or has gone)."""
        while True:
            await asyncio.sleep(self.config.touch_interval_s)
            try:
                status = await self._store.touch(lease)
            except Unavailable:
                continue
            if status is None or status is JobStatus.CANCELLED:
                work.cancel()
                return

    async def _infer(self, job: Job) -> bytes:
        dataplane = self._dataplane
        request = decode(
            dataplane, job.kind, job.model, job.version, job.request, job.header_length
        )
        _as_json(request)
        response = await dataplane.infer_job(request)
        if job.kind is RequestKind.RECORDS:
            return kserve_v1.encode_predictions(response)
        return _encode(request, response)


def _as_json(request: InferRequest) -> None:
    """A job's result is read back inside a JSON document: no binary outputs."""
    request.parameters.pop("binary_data_output", None)
    for output in request.outputs or ():
        output.parameters.pop("binary_data", None)


def _encode(request: InferRequest, response: InferResponse) -> bytes:
    body, _ = oip.encode_response(request, response)
    return body
