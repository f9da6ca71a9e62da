"""The job stores' promises (`jobs/store.py`'s docstring), each test against the in-process
store and against Redis (`jobs/redis_store.py`) on the session's redis-server; then what only
Redis has: the keys' expiry as Redis keeps it, Redis down, and a Redis Cluster.

Times: the stores take a fake clock for the jobs' times. The in-process store also keeps its
visibility timeout by it; Redis keeps that by its own clock, so there a short timeout really
passes (`Backend.elapse`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio import Redis

from support.servers import (
    OwnRedisServer,
    RedisServer,
    RunningRedisCluster,
    async_wait_for,
    kill_redis,
    pause_redis,
    restart_redis,
    resume_redis,
)
from tailserve.cache.redis import connect
from tailserve.errors import QueueFull, Unavailable
from tailserve.jobs.records import Job, JobStatus, Lease, RequestKind
from tailserve.jobs.redis_store import RedisJobStore
from tailserve.jobs.store import JobStore, MemoryJobStore

KINDS = ("memory", "redis")
HOLD_S = 30.0  # long enough that no test's hold lapses unless it means it to
SHORT_HOLD_S = 0.2


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Backend:
    """Where a test's stores keep their jobs: the in-process store, or a key prefix of its
    own on the session's Redis (with ``admin``, a client to look inside as an operator)."""

    kind: str
    clock: Clock
    url: str = ""
    prefix: str = ""
    admin: Any = None
    opened: list[JobStore] = field(default_factory=list)

    def open(self, *, hold_s: float = HOLD_S, socket_timeout_s: float = 10.0) -> JobStore:
        """A store (a worker's); on Redis, its client's socket timeout bounds each blocking
        read, a longer one lets a take wait in one read. (Not the 1 s a worker's client has:
        beside the timing tests this one may get no CPU for longer.)"""
        store: JobStore
        if self.kind == "memory":
            store = MemoryJobStore(clock=self.clock, visibility_timeout_s=hold_s)
        else:
            client = connect(
                self.url, timeout_s=5.0, socket_timeout=socket_timeout_s, client_name=self.prefix
            )
            store = RedisJobStore(
                client, clock=self.clock, visibility_timeout_s=hold_s, prefix=self.prefix
            )
        self.opened.append(store)
        return store

    async def elapse(self, seconds: float) -> None:
        """Let ``seconds`` pass on the clocks the store keeps holds by (Redis: real time)."""
        self.clock.advance(seconds)
        if self.kind == "redis":
            await asyncio.sleep(seconds)

    async def until_waiting(self) -> None:
        """Until a take started by the test waits for a job."""
        if self.kind == "memory":
            await asyncio.sleep(0)  # the take runs up to its wait, which is its first await
            return

        await async_wait_for(
            lambda: blocked_in_xread(self.admin, self.prefix),
            timeout_s=5.0,
            what="a take blocked in XREAD",
        )

    def key(self, job_id: str) -> str:
        return f"{{{self.prefix}}}:job:{job_id}"


async def blocked_in_xread(admin: Any, name: str) -> bool:
    """Whether a connection named ``name`` is blocked in XREAD on ``admin``'s server."""
    clients = await admin.client_list()
    return any(c["name"] == name and c["cmd"] == "xread" and "b" in c["flags"] for c in clients)


@contextlib.asynccontextmanager
async def on_redis(url: str) -> AsyncIterator[Backend]:
    """A key prefix of the test's own on the Redis at ``url``, its keys deleted after."""
    prefix = f"test-jobs-{uuid.uuid4().hex[:12]}"
    found = Backend("redis", Clock(), url, prefix, Redis.from_url(url))
    try:
        yield found
    finally:
        for store in found.opened:
            await store.close()
        async for key in found.admin.scan_iter(match=f"{{{prefix}}}:*", count=10_000):
            await found.admin.unlink(key)
        await found.admin.aclose()


@pytest.fixture(params=KINDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        found = Backend("memory", Clock())
        yield found
        for store in found.opened:
            await store.close()
        return
    server: RedisServer = request.getfixturevalue("redis")
    async with on_redis(server.url) as found:
        yield found


@pytest.fixture
def store(backend: Backend) -> JobStore:
    return backend.open()


def make_job(clock: Clock, model: str = "m", **fields: Any) -> Job:
    """A fresh job, created now by ``clock``, which then ticks (so jobs list in order)."""
    fields = {"version": None, "kind": RequestKind.OIP, "request": b'{"inputs": []}', **fields}
    job = Job(id=uuid.uuid4().hex, model=model, created_at=clock(), **fields)
    clock.advance(0.001)
    return job


async def submit(store: JobStore, clock: Clock, model: str = "m", **fields: Any) -> Job:
    job = make_job(clock, model, **fields)
    await store.submit(job, max_queued=100)
    return job


async def take_one(store: JobStore, models: list[str], worker: str) -> Lease:
    leases = await store.take(models, worker, 1, 0)
    assert len(leases) == 1, leases
    return leases[0]


async def test_a_submitted_job_reads_back_as_it_was(store: JobStore, backend: Backend) -> None:
    full = make_job(
        backend.clock,
        "ranker",
        version="3",
        header_length=7,
        priority=2,
        webhook="http://127.0.0.1:9/hook",
        result_ttl_s=12.5,
        request=b'{"a":1}\x00\xff\xfe binary',
        kind=RequestKind.RECORDS,
    )
    bare = make_job(backend.clock)
    for job in (full, bare):
        await store.submit(job, max_queued=10)
        assert await store.get(job.id) == job
    assert await store.get("no-such-job") is None
    assert await store.cancel("no-such-job") is None


async def test_a_model_at_its_bound_refuses_until_a_job_finishes(
    store: JobStore, backend: Backend
) -> None:
    first = make_job(backend.clock, "small")
    await store.submit(first, max_queued=2)
    await store.submit(make_job(backend.clock, "small"), max_queued=2)
    with pytest.raises(QueueFull) as refused:
        await store.submit(make_job(backend.clock, "small"), max_queued=2)
    assert refused.value.retry_after_s == 1.0
    assert "'small'" in refused.value.message and "2" in refused.value.message
    await store.submit(make_job(backend.clock, "other"), max_queued=2)  # a bound per model

    lease = await take_one(store, ["small"], "w")
    assert lease.job.id == first.id
    with pytest.raises(QueueFull):  # a running job still counts
        await store.submit(make_job(backend.clock, "small"), max_queued=2)
    await store.finish(lease, result=b"{}")
    await store.submit(make_job(backend.clock, "small"), max_queued=2)


async def test_the_first_listed_model_goes_first_and_each_queue_in_order(
    store: JobStore, backend: Backend
) -> None:
    low1 = await submit(store, backend.clock, "low")
    high1 = await submit(store, backend.clock, "high")
    low2 = await submit(store, backend.clock, "low")
    high2 = await submit(store, backend.clock, "high")

    leases = await store.take(["high", "low"], "w", 3, 0)
    assert [lease.job.id for lease in leases] == [high1.id, high2.id, low1.id]
    assert all(lease.job.status is JobStatus.RUNNING for lease in leases)
    assert all(lease.job.worker == "w" and lease.job.attempts == 1 for lease in leases)
    assert all(lease.job.started_at == backend.clock() for lease in leases)
    assert [lease.job.id for lease in await store.take(["high", "low"], "w", 3, 0)] == [low2.id]
    assert await store.take(["high", "low"], "w", 3, 0) == []
    assert (await store.get(high1.id)) == leases[0].job


async def test_a_queued_job_cancelled_is_never_taken_and_frees_its_place(
    store: JobStore, backend: Backend
) -> None:
    first = make_job(backend.clock)
    second = make_job(backend.clock)
    await store.submit(first, max_queued=2)
    await store.submit(second, max_queued=2)
    cancelled = await store.cancel(first.id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    assert cancelled.finished_at == backend.clock()
    third = make_job(backend.clock)
    await store.submit(third, max_queued=2)  # its place is free

    taken = await store.take(["m"], "w", 5, 0)
    assert [lease.job.id for lease in taken] == [second.id, third.id]
    found = await store.get(first.id)
    assert found is not None and found.status is JobStatus.CANCELLED


async def test_a_running_job_cancelled_drops_its_result(store: JobStore, backend: Backend) -> None:
    job = await submit(store, backend.clock)
    lease = await take_one(store, ["m"], "w")
    cancelled = await store.cancel(job.id)
    assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
    assert await store.touch(lease) is JobStatus.CANCELLED
    assert await store.finish(lease, result=b'{"late": true}') is None
    found = await store.get(job.id)
    assert found is not None and found.status is JobStatus.CANCELLED and found.result is None
    again = await store.cancel(job.id)  # cancelling a finished job changes nothing
    assert again is not None and again.finished_at == cancelled.finished_at


async def test_the_first_outcome_written_wins(store: JobStore, backend: Backend) -> None:
    job = await submit(store, backend.clock)
    lease = await take_one(store, ["m"], "w")
    backend.clock.advance(2.0)
    finished = await store.finish(lease, result=b'{"first": 1}')
    assert finished is not None and finished.status is JobStatus.SUCCEEDED
    assert finished.finished_at == backend.clock() and finished.timings()["run_ms"] == 2000.0
    assert await store.finish(lease, result=b'{"second": 2}') is None
    assert await store.finish(lease, error="too late") is None
    found = await store.get(job.id)
    assert found is not None and found.result == b'{"first": 1}' and found.error is None

    failing = await submit(store, backend.clock)
    failed = await store.finish(await take_one(store, ["m"], "w"), error="model exploded")
    assert failed is not None and failed.status is JobStatus.FAILED
    found = await store.get(failing.id)
    assert found is not None and found.error == "model exploded" and found.result is None


async def poll_take(store: JobStore, models: list[str], worker: str) -> Lease:
    """Take until a job comes (a lapsed hold comes back by the store's clock)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        leases = await store.take(models, worker, 1, SHORT_HOLD_S / 2)
        if leases:
            assert len(leases) == 1
            return leases[0]
    raise AssertionError("no job came back within 10 s")


async def test_a_hold_not_touched_lapses_to_another_worker_and_one_result_is_kept(
    backend: Backend,
) -> None:
    store = backend.open(hold_s=SHORT_HOLD_S)
    job = await submit(store, backend.clock)
    later = await submit(store, backend.clock)
    stalled = await take_one(store, ["m"], "a")
    await backend.elapse(SHORT_HOLD_S * 1.5)

    retaken = await poll_take(store, ["m"], "b")
    assert retaken.job.id == job.id  # back at the head, before the later job
    assert retaken.job.attempts == 2 and retaken.job.worker == "b"
    assert retaken.job.started_at == stalled.job.started_at
    assert await store.touch(stalled) is JobStatus.RUNNING  # still running (on b)

    first = await store.finish(stalled, result=b'{"from": "a"}')
    assert first is not None and first.result == b'{"from": "a"}'
    assert await store.finish(retaken, result=b'{"from": "b"}') is None
    found = await store.get(job.id)
    assert found is not None and found.result == b'{"from": "a"}'
    assert found.status is JobStatus.SUCCEEDED
    assert (await take_one(store, ["m"], "b")).job.id == later.id


async def test_touching_a_job_keeps_it_held(backend: Backend) -> None:
    store = backend.open(hold_s=SHORT_HOLD_S)
    job = await submit(store, backend.clock)
    lease = await take_one(store, ["m"], "a")
    await backend.elapse(SHORT_HOLD_S * 1.5)
    assert await store.touch(lease) is JobStatus.RUNNING
    assert await store.take(["m"], "b", 1, 0) == []

    await backend.elapse(SHORT_HOLD_S * 1.5)  # now untouched past the timeout
    assert (await poll_take(store, ["m"], "b")).job.id == job.id


async def test_a_released_job_goes_back_to_the_head_of_its_queue(
    store: JobStore, backend: Backend
) -> None:
    first = await submit(store, backend.clock)
    second = await submit(store, backend.clock)
    lease = await take_one(store, ["m"], "a")
    assert lease.job.id == first.id
    await store.release(lease)
    found = await store.get(first.id)
    assert found is not None and found.status is JobStatus.QUEUED and found.worker is None

    again = await take_one(store, ["m"], "b")
    assert again.job.id == first.id and again.job.attempts == 2 and again.job.worker == "b"
    assert (await take_one(store, ["m"], "b")).job.id == second.id


async def test_listing_filters_newest_first_and_says_when_more_matched(
    store: JobStore, backend: Backend
) -> None:
    a1 = await submit(store, backend.clock, "a")
    b1 = await submit(store, backend.clock, "b")
    a2 = await submit(store, backend.clock, "a")
    a3 = await submit(store, backend.clock, "a")
    await store.finish(await take_one(store, ["a"], "w"), result=b'{"big": "result"}')

    every = await store.list(model=None, status=None, limit=10)
    assert [j.id for j in every.jobs] == [a3.id, a2.id, b1.id, a1.id] and not every.truncated
    assert all(j.request == b"" and j.result is None for j in every.jobs)
    assert every.jobs[-1].status is JobStatus.SUCCEEDED

    of_a = await store.list(model="a", status=None, limit=10)
    assert [j.id for j in of_a.jobs] == [a3.id, a2.id, a1.id]
    queued_a = await store.list(model="a", status=JobStatus.QUEUED, limit=10)
    assert [j.id for j in queued_a.jobs] == [a3.id, a2.id]
    succeeded = await store.list(model=None, status=JobStatus.SUCCEEDED, limit=10)
    assert [j.id for j in succeeded.jobs] == [a1.id]

    page = await store.list(model="a", status=None, limit=2)
    assert [j.id for j in page.jobs] == [a3.id, a2.id] and page.truncated
    exact = await store.list(model="b", status=None, limit=1)
    assert [j.id for j in exact.jobs] == [b1.id] and not exact.truncated


async def test_a_finished_job_is_kept_for_its_result_ttl(store: JobStore, backend: Backend) -> None:
    job = await submit(store, backend.clock, result_ttl_s=60.0)
    await store.finish(await take_one(store, ["m"], "w"), result=b"{}")
    assert await store.get(job.id) is not None
    if backend.kind == "memory":
        backend.clock.advance(59.0)
        assert await store.get(job.id) is not None
        backend.clock.advance(2.0)
        assert await store.get(job.id) is None
        assert (await store.list(model=None, status=None, limit=10)).jobs == []
    else:
        ttl_ms = await backend.admin.pttl(backend.key(job.id))
        assert 0 < ttl_ms <= 60_000


async def test_a_take_that_waits_returns_as_soon_as_a_job_comes(backend: Backend) -> None:
    store = backend.open(socket_timeout_s=30.0)  # one read could wait out the whole take
    job = make_job(backend.clock)
    started = time.monotonic()

    async def submit_once_waiting() -> None:
        await backend.until_waiting()
        await store.submit(job, max_queued=10)

    leases, _ = await asyncio.gather(store.take(["other", "m"], "w", 1, 5.0), submit_once_waiting())
    assert [lease.job.id for lease in leases] == [job.id]
    assert time.monotonic() - started < 2.5


async def test_a_take_that_waits_is_woken_by_a_job_put_back(backend: Backend) -> None:
    store = backend.open(socket_timeout_s=30.0)
    job = await submit(store, backend.clock)
    lease = await take_one(store, ["m"], "a")
    started = time.monotonic()

    async def release_once_waiting() -> None:
        await backend.until_waiting()
        await store.release(lease)

    leases, _ = await asyncio.gather(store.take(["m"], "b", 1, 5.0), release_once_waiting())
    assert [lease.job.id for lease in leases] == [job.id]
    assert time.monotonic() - started < 2.5


async def test_webhook_outcomes_are_recorded(store: JobStore, backend: Backend) -> None:
    job = await submit(store, backend.clock, webhook="http://127.0.0.1:9/hook")
    await store.note_webhook(job.id, attempts=2, delivered=False, error="HTTP 500")
    found = await store.get(job.id)
    assert found is not None
    assert (found.webhook_attempts, found.webhook_delivered, found.webhook_error) == (
        2,
        False,
        "HTTP 500",
    )
    await store.note_webhook(job.id, attempts=3, delivered=True, error=None)
    found = await store.get(job.id)
    assert found is not None
    assert (found.webhook_attempts, found.webhook_delivered, found.webhook_error) == (3, True, None)
    await store.note_webhook("no-such-job", attempts=1, delivered=True, error=None)
    assert await store.get("no-such-job") is None


async def test_an_outcome_for_a_job_put_back_is_dropped(store: JobStore, backend: Backend) -> None:
    job = await submit(store, backend.clock)
    lease = await take_one(store, ["m"], "a")
    await store.release(lease)
    assert await store.finish(lease, result=b'{"from": "a"}') is None
    again = await take_one(store, ["m"], "b")
    assert again.job.id == job.id and again.job.result is None
    finished = await store.finish(again, result=b'{"from": "b"}')
    assert finished is not None and finished.result == b'{"from": "b"}'


async def test_a_lapsed_lease_cannot_put_back_a_job_another_worker_runs(
    backend: Backend,
) -> None:
    store = backend.open(hold_s=SHORT_HOLD_S)
    job = await submit(store, backend.clock)
    stalled = await take_one(store, ["m"], "a")
    await backend.elapse(SHORT_HOLD_S * 1.5)
    retaken = await poll_take(store, ["m"], "b")
    await store.release(stalled)
    found = await store.get(job.id)
    assert found is not None and found.status is JobStatus.RUNNING and found.worker == "b"
    assert await store.take(["m"], "c", 1, 0) == []  # not queued a third time
    assert await store.finish(retaken, result=b"{}") is not None


# --- Redis only ------------------------------------------------------------------------------


@pytest.fixture
async def redis_backend(redis: RedisServer) -> AsyncIterator[Backend]:
    async with on_redis(redis.url) as found:
        yield found


async def test_a_queued_job_expires_after_the_queued_ttl(redis_backend: Backend) -> None:
    client = connect(redis_backend.url, timeout_s=5.0)
    store = RedisJobStore(client, queued_ttl_s=120.0, prefix=redis_backend.prefix)
    redis_backend.opened.append(store)
    job = await submit(store, redis_backend.clock)
    ttl_ms = await redis_backend.admin.pttl(redis_backend.key(job.id))
    assert 0 < ttl_ms <= 120_000


async def test_a_long_wait_outlasts_the_clients_socket_timeout(redis_backend: Backend) -> None:
    # (Reads of half the socket timeout: a second, which a read held up by a busy machine
    # may take without being cut short.)
    store = redis_backend.open(socket_timeout_s=2.0)
    started = time.monotonic()
    assert await store.take(["m"], "w", 1, 3.0) == []  # not Unavailable: no read outlived it
    assert time.monotonic() - started >= 3.0
    job = await submit(store, redis_backend.clock)
    assert (await take_one(store, ["m"], "w")).job.id == job.id


async def test_jobs_gone_from_redis_leave_the_listing(redis_backend: Backend) -> None:
    store = redis_backend.open()
    kept = await submit(store, redis_backend.clock)
    lost = await submit(store, redis_backend.clock)
    await redis_backend.admin.delete(redis_backend.key(lost.id))  # as if expired
    listing = await store.list(model=None, status=None, limit=10)
    assert [j.id for j in listing.jobs] == [kept.id]
    index = await redis_backend.admin.zrange(f"{{{redis_backend.prefix}}}:index", 0, -1)
    assert index == [kept.id.encode()]
    # Its stream entry is skipped when its turn comes.
    assert (await take_one(store, ["m"], "w")).job.id == kept.id
    assert await store.take(["m"], "w", 1, 0) == []


async def test_redis_down_or_paused_is_unavailable(own_redis: OwnRedisServer) -> None:
    clock = Clock()
    store = RedisJobStore(connect(own_redis.url, timeout_s=2.0), clock=clock)
    try:
        await submit(store, clock)
        kill_redis(own_redis)
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: store.get("x"),
            lambda: store.take(["m"], "w", 1, 0),
            lambda: store.submit(make_job(clock), max_queued=10),
            lambda: store.list(model=None, status=None, limit=10),
        ]
        for call in calls:
            with pytest.raises(Unavailable, match=r"the job store \(Redis\) cannot be reached"):
                await call()

        restart_redis(own_redis)  # empty, on the same port
        await submit(store, clock)
        assert len(await store.take(["m"], "w", 5, 0)) == 1

        pause_redis(own_redis)
        try:
            started = time.monotonic()
            with pytest.raises(Unavailable) as refused:
                await store.get("x")
            assert refused.value.retry_after_s == 1.0
            assert time.monotonic() - started < 5.0
        finally:
            resume_redis(own_redis)
    finally:
        await store.close()


async def test_jobs_on_a_redis_cluster(redis_cluster: RunningRedisCluster) -> None:
    clock = Clock()
    prefix = f"test-jobs-{uuid.uuid4().hex[:12]}"
    client = connect(redis_cluster.url, cluster=True, timeout_s=5.0, client_name=prefix)
    store = RedisJobStore(client, clock=clock, prefix=prefix)
    # The node that serves the prefix's slot: every key of the store is there.
    owner = Redis(port=redis_cluster.owner(f"{{{prefix}}}"))
    try:
        low = await submit(store, clock, "low")
        high = await submit(store, clock, "high")
        leases = await store.take(["high", "low"], "w", 2, 0)
        assert [lease.job.id for lease in leases] == [high.id, low.id]
        assert await store.touch(leases[0]) is JobStatus.RUNNING
        finished = await store.finish(leases[0], result=b'{"ok": true}')
        assert finished is not None and finished.status is JobStatus.SUCCEEDED
        assert await store.finish(leases[0], result=b"{}") is None
        cancelled = await store.cancel(low.id)
        assert cancelled is not None and cancelled.status is JobStatus.CANCELLED
        listing = await store.list(model=None, status=None, limit=10)
        assert [j.id for j in listing.jobs] == [high.id, low.id]
        assert await owner.exists(f"{{{prefix}}}:job:{high.id}") == 1

        waiting = make_job(clock, "low")
        take = asyncio.create_task(store.take(["high", "low"], "w", 1, 5.0))
        await async_wait_for(
            lambda: blocked_in_xread(owner, prefix), timeout_s=5.0, what="the take to block"
        )
        started = time.monotonic()
        await store.submit(waiting, max_queued=10)
        assert [lease.job.id for lease in await take] == [waiting.id]
        assert time.monotonic() - started < 2.5
    finally:
        await store.close()
        async for key in owner.scan_iter(match=f"{{{prefix}}}:*", count=10_000):
            await owner.unlink(key)
        await owner.aclose()
