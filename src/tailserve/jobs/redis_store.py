"""The durable job store: jobs in Redis (or Redis Cluster), shared by every worker.

It keeps the promises of `store.JobStore` (see `store`'s docstring). Layout, every key under
one hash tag so that a script's keys, and a read of several streams, share a cluster slot::

    {tailserve:jobs}:job:<id>     hash: the job's fields, and ``entry``, its stream entry
    {tailserve:jobs}:q:<model>    stream: an entry (``id``) per job waiting or running, read
                                  by the consumer group ``workers``, a consumer per worker
    {tailserve:jobs}:index        sorted set: job id -> created_at, for listing
    {tailserve:jobs}:bell         stream of one entry, rung when a job is put back

Each change of a job is one Lua script, so it is atomic. A job's entry stays in its stream
while it waits or runs and is acked and deleted when it finishes or is cancelled, so XLEN is
the model's jobs waiting or running, the number the bound counts. A taken entry is pending
for its worker; its worker's touches claim it afresh (resetting its idle time), and one idle
past the visibility timeout (Redis's own clock) is claimed by the next take, before any new
entry: back at the head of its queue. ``release`` marks the entry idle since the epoch, so
the next take claims it first. An outcome is written only for a job still running.

A take is one script over the models in the caller's order. When it finds nothing and may
wait, it blocks in XREAD on the streams (and the bell) from their last entries as the script
saw them, so nothing added after the script is missed, then runs the script again. Each
block is kept shorter than the client's socket timeout (which would otherwise cut it short
and read as Redis being down): one client serves both, whatever its timeout.

The client: a redis-py asyncio ``Redis`` or ``RedisCluster`` with ``decode_responses`` off,
as `tailserve.cache.redis.connect` makes it; the store owns it and closes it. Redis 7 or
later (XAUTOCLAIM's reply). Redis unreachable, timing out or failing over is `Unavailable`.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis import exceptions as redis_errors

from tailserve.errors import QueueFull, Unavailable
from tailserve.jobs.records import Job, JobStatus, Lease, Listing, RequestKind
from tailserve.jobs.store import LIST_SCAN

# Redis unreachable, or failing over, full or read-only; a command's own error is a bug.
_UNREACHABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)
_FAILING = (
    redis_errors.ClusterError,
    redis_errors.TryAgainError,
    redis_errors.ReadOnlyError,
    redis_errors.OutOfMemoryError,
)
_PAGE = 500

_COMMON = """
local function finished(status)
  return status == 'succeeded' or status == 'failed' or status == 'cancelled'
end
local function drop(q, entry)
  if entry and redis.call('EXISTS', q) == 1 then
    redis.call('XACK', q, 'workers', entry)
    redis.call('XDEL', q, entry)
  end
end
local function close(key, status, now, q, entry)
  redis.call('HSET', key, 'status', status, 'finished_at', now)
  drop(q, entry)
  local ttl = tonumber(redis.call('HGET', key, 'result_ttl_s')) or 3600
  redis.call('PEXPIRE', key, math.max(1, math.ceil(ttl * 1000)))
end
"""

# KEYS: job, stream, index. ARGV: bound, queued ttl (ms), id, created_at, job key prefix,
# then the job's fields and values. -1: queued; else the count that refused it.
_SUBMIT = """
local waiting = redis.call('XLEN', KEYS[2])
if waiting >= tonumber(ARGV[1]) then return waiting end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[2], 'workers', '0', 'MKSTREAM')
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[3])
redis.call('HSET', KEYS[1], 'entry', entry)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
-- Forget the oldest listed jobs once gone, so the index does not outgrow the jobs.
for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, 1)) do
  if redis.call('EXISTS', ARGV[5] .. id) == 0 then redis.call('ZREM', KEYS[3], id) end
end
return -1
"""

# KEYS: the models' streams in order, then the bell. ARGV: worker, count, visibility (ms),
# now, job key prefix, '1' for the streams' last entries when nothing was taken.
_TAKE = (
    _COMMON
    + """
local worker, want, idle, now, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local taken = {}
local function start(q, item)
  local id = nil
  for i = 1, #item[2], 2 do
    if item[2][i] == 'id' then id = item[2][i + 1] end
  end
  local key = prefix .. (id or '')
  local found = redis.call('HMGET', key, 'status', 'entry')
  if not found[1] or finished(found[1]) or found[2] ~= item[1] then
    drop(q, item[1])
    return
  end
  redis.call('HSET', key, 'status', 'running', 'worker', worker)
  redis.call('HSETNX', key, 'started_at', now)
  redis.call('HINCRBY', key, 'attempts', 1)
  taken[#taken + 1] = {item[1], redis.call('HGETALL', key)}
end
for i = 1, #KEYS - 1 do
  local q = KEYS[i]
  if #taken < want and redis.call('EXISTS', q) == 1 then
    local cursor = '0-0'
    repeat
      local r = redis.call('XAUTOCLAIM', q, 'workers', worker, idle, cursor, 'COUNT', want - #taken)
      cursor = r[1]
      for _, item in ipairs(r[2]) do start(q, item) end
    until cursor == '0-0' or #taken >= want
    while #taken < want do
      local r = redis.call('XREADGROUP', 'GROUP', 'workers', worker, 'COUNT', want - #taken,
        'STREAMS', q, '>')
      if not r then break end
      for _, item in ipairs(r[1][2]) do start(q, item) end
    end
  end
end
local marks = {}
if #taken == 0 and ARGV[6] == '1' then
  for i = 1, #KEYS do
    local last = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)
    marks[i] = last[1] and last[1][1] or '0-0'
  end
end
return {taken, marks}
"""
)

# KEYS: job, stream. ARGV: worker, entry. The job's status (nil: gone).
_TOUCH = """
local found = redis.call('HMGET', KEYS[1], 'status', 'worker', 'entry')
if not found[1] then return nil end
if found[1] == 'running' and found[2] == ARGV[1] and found[3] == ARGV[2] then
  redis.call('XCLAIM', KEYS[2], 'workers', ARGV[1], 0, ARGV[2], 'JUSTID')
end
return found[1]
"""

# KEYS: job, stream. ARGV: entry, status, now, '1' and the result, '1' and the error.
_FINISH = (
    _COMMON
    + """
local found = redis.call('HMGET', KEYS[1], 'status', 'entry')
if not found[1] or finished(found[1]) then
  drop(KEYS[2], ARGV[1])
  return nil
end
-- Put back (queued): its entry waits to be taken again, and the outcome is dropped.
if found[1] ~= 'running' then return nil end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'result', ARGV[5])
else redis.call('HDEL', KEYS[1], 'result') end
if ARGV[6] == '1' then redis.call('HSET', KEYS[1], 'error', ARGV[7])
else redis.call('HDEL', KEYS[1], 'error') end
if found[2] and found[2] ~= ARGV[1] then drop(KEYS[2], ARGV[1]) end
close(KEYS[1], ARGV[2], ARGV[3], KEYS[2], found[2] or ARGV[1])
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: job. ARGV: now, stream key prefix.
_CANCEL = (
    _COMMON
    + """
local found = redis.call('HMGET', KEYS[1], 'status', 'model', 'entry')
if not found[1] then return nil end
if not finished(found[1]) then
  close(KEYS[1], 'cancelled', ARGV[1], ARGV[2] .. found[2], found[3])
end
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: job, stream, bell. ARGV: worker, entry.
_RELEASE = (
    _COMMON
    + """
local found = redis.call('HMGET', KEYS[1], 'status', 'worker', 'entry')
if not found[1] then
  drop(KEYS[2], ARGV[2])
  return 0
end
if found[1] ~= 'running' or found[2] ~= ARGV[1] or found[3] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('HDEL', KEYS[1], 'worker')
-- Idle since the epoch: the next take claims it before anything newer.
redis.call('XCLAIM', KEYS[2], 'workers', ARGV[1], 0, ARGV[2], 'TIME', 0, 'JUSTID')
redis.call('XADD', KEYS[3], 'MAXLEN', 1, '*', 'put-back', ARGV[2])
return 1
"""
)

# KEYS: job. ARGV: attempts, delivered ('1', '0', '': not known), '1' and the error.
_WEBHOOK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'webhook_attempts', ARGV[1])
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], 'webhook_delivered')
else redis.call('HSET', KEYS[1], 'webhook_delivered', ARGV[2]) end
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'webhook_error', ARGV[4])
else redis.call('HDEL', KEYS[1], 'webhook_error') end
return 1
"""

# What a listing reads of each job: all but the request and the result.
_LISTED = tuple(f.name for f in dataclasses.fields(Job) if f.name not in ("request", "result"))


class RedisJobStore:
    """Jobs in Redis (see the module's docstring). ``clock``: the wall clock, for the jobs'
    times (the visibility timeout is kept by Redis's clock); ``queued_ttl_s``: how long a job
    may wait or run before it is forgotten."""

    durable = True

    def __init__(
        self,
        client: Any,
        *,
        clock: Callable[[], float] = time.time,
        visibility_timeout_s: float = 30.0,
        queued_ttl_s: float = 7 * 86400,
        prefix: str = "tailserve:jobs",
    ) -> None:
        self._client = client
        self._clock = clock
        self._visibility_ms = max(1, round(visibility_timeout_s * 1000))
        self._queued_ttl_ms = max(1, round(queued_ttl_s * 1000))
        tag = f"{{{prefix}}}"
        self._job_prefix = f"{tag}:job:"
        self._queue_prefix = f"{tag}:q:"
        self._index = f"{tag}:index"
        self._bell = f"{tag}:bell"
        self._longest_block_s = _longest_block(client)
        self._submit = client.register_script(_SUBMIT)
        self._take = client.register_script(_TAKE)
        self._touch = client.register_script(_TOUCH)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)
        self._release = client.register_script(_RELEASE)
        self._webhook = client.register_script(_WEBHOOK)

    async def submit(self, job: Job, *, max_queued: int) -> None:
        fields = [item for pair in _fields(job).items() for item in pair]
        keys = [self._job_prefix + job.id, self._queue_prefix + job.model, self._index]
        args = [max_queued, self._queued_ttl_ms, job.id, repr(job.created_at), self._job_prefix]
        with _boundary():
            waiting = int(await self._submit(keys=keys, args=[*args, *fields]))
        if waiting >= 0:
            raise QueueFull(
                f"model {job.model!r} has {waiting} jobs waiting or running, its bound "
                f"({max_queued}): try again later",
                retry_after_s=1.0,
            )

    async def get(self, job_id: str) -> Job | None:
        with _boundary():
            found = await self._client.hgetall(self._job_prefix + job_id)
        return _job(_texts(found)) if found else None

    async def cancel(self, job_id: str) -> Job | None:
        args = [repr(self._clock()), self._queue_prefix]
        with _boundary():
            found = await self._cancel(keys=[self._job_prefix + job_id], args=args)
        return _job(_pairs(found)) if found else None

    async def list(self, *, model: str | None, status: JobStatus | None, limit: int) -> Listing:
        found: list[Job] = []
        gone: list[str] = []
        scanned = 0
        truncated = False
        with _boundary():
            while not truncated:
                page = await self._client.zrevrange(self._index, scanned, scanned + _PAGE - 1)
                ids = [_text(i) for i in page]
                async with self._client.pipeline(transaction=False) as pipe:
                    for job_id in ids:
                        pipe.hmget(self._job_prefix + job_id, _LISTED)
                    rows = await pipe.execute()
                for job_id, row in zip(ids, rows, strict=True):
                    if scanned >= LIST_SCAN:
                        truncated = True
                        break
                    scanned += 1
                    if row[0] is None:
                        gone.append(job_id)
                        continue
                    job = _job({k: v for k, v in zip(_LISTED, row, strict=True) if v is not None})
                    if (model is None or job.model == model) and (
                        status is None or job.status == status
                    ):
                        if len(found) == limit:
                            truncated = True
                            break
                        found.append(job)
                if len(page) < _PAGE:
                    break
            if gone:
                # Removed after the scan, so that the pages' ranks held while it read them.
                await self._client.zrem(self._index, *gone)
        return Listing(found, truncated=truncated)

    async def take(
        self, models: Sequence[str], worker: str, count: int, wait_s: float
    ) -> builtins.list[Lease]:
        if count <= 0:
            return []
        keys = [*(self._queue_prefix + m for m in models), self._bell]
        deadline = time.monotonic() + wait_s
        with _boundary():
            while True:
                args = [worker, count, self._visibility_ms, repr(self._clock()), self._job_prefix]
                taken, marks = await self._take(keys=keys, args=[*args, int(wait_s > 0)])
                if taken:
                    return [Lease(_job(_pairs(fields)), _text(entry)) for entry, fields in taken]
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                if self._longest_block_s is not None:
                    left = min(left, self._longest_block_s)
                # Wakes at an entry added after the script looked (a job, a put-back one).
                streams = dict(zip(keys, marks, strict=True))
                await self._client.xread(streams, count=1, block=max(1, math.ceil(left * 1000)))

    async def touch(self, lease: Lease) -> JobStatus | None:
        keys = [self._job_prefix + lease.job.id, self._queue_prefix + lease.job.model]
        with _boundary():
            status = await self._touch(keys=keys, args=[lease.job.worker or "", lease.entry])
        return JobStatus(_text(status)) if status is not None else None

    async def finish(
        self, lease: Lease, *, result: bytes | None = None, error: str | None = None
    ) -> Job | None:
        status = JobStatus.FAILED if error is not None else JobStatus.SUCCEEDED
        keys = [self._job_prefix + lease.job.id, self._queue_prefix + lease.job.model]
        args: builtins.list[str | bytes | int] = [lease.entry, status.value, repr(self._clock())]
        args += [int(result is not None), result or b"", int(error is not None), error or ""]
        with _boundary():
            found = await self._finish(keys=keys, args=args)
        return _job(_pairs(found)) if found else None

    async def release(self, lease: Lease) -> None:
        job = lease.job
        keys = [self._job_prefix + job.id, self._queue_prefix + job.model, self._bell]
        with _boundary():
            await self._release(keys=keys, args=[job.worker or "", lease.entry])

    async def note_webhook(
        self, job_id: str, *, attempts: int, delivered: bool | None, error: str | None
    ) -> None:
        shown = "" if delivered is None else str(int(delivered))
        args = [attempts, shown, int(error is not None), error or ""]
        with _boundary():
            await self._webhook(keys=[self._job_prefix + job_id], args=args)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()


@contextlib.contextmanager
def _boundary() -> Iterator[None]:
    """Redis's faults as `Unavailable` (503, with a retry hint)."""
    try:
        yield
    except _UNREACHABLE as exc:
        raise Unavailable(
            f"the job store (Redis) cannot be reached: {type(exc).__name__}: {exc}",
            retry_after_s=1.0,
        ) from None
    except _FAILING as exc:
        raise Unavailable(
            f"the job store (Redis) is failing: {type(exc).__name__}: {exc}", retry_after_s=1.0
        ) from None


def _longest_block(client: Any) -> float | None:
    """How long one blocking read may wait (None: as long as it likes): half the client's
    socket timeout, so that a reply read late by a busy event loop is not taken for a
    Redis that does not answer."""
    timeout = client.get_connection_kwargs().get("socket_timeout")
    return None if timeout is None else float(timeout) / 2


def _fields(job: Job) -> dict[str, str | bytes]:
    """The job as a hash: None is an absent field."""
    fields: dict[str, str | bytes] = {
        "id": job.id,
        "model": job.model,
        "kind": job.kind.value,
        "request": job.request,
        "priority": str(job.priority),
        "created_at": repr(job.created_at),
        "status": job.status.value,
        "attempts": str(job.attempts),
        "webhook_attempts": str(job.webhook_attempts),
        "result_ttl_s": repr(float(job.result_ttl_s)),
    }
    optional: dict[str, str | bytes | None] = {
        "version": job.version,
        "header_length": None if job.header_length is None else str(job.header_length),
        "started_at": None if job.started_at is None else repr(job.started_at),
        "finished_at": None if job.finished_at is None else repr(job.finished_at),
        "worker": job.worker,
        "result": job.result,
        "error": job.error,
        "webhook": job.webhook,
        "webhook_delivered": None
        if job.webhook_delivered is None
        else str(int(job.webhook_delivered)),
        "webhook_error": job.webhook_error,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return fields


def _job(fields: dict[str, bytes]) -> Job:
    def text(name: str) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode()

    def number(name: str) -> float | None:
        value = fields.get(name)
        return float(value) if value else None

    delivered = fields.get("webhook_delivered")
    header_length = fields.get("header_length")
    return Job(
        id=fields["id"].decode(),
        model=fields["model"].decode(),
        version=text("version") or None,
        kind=RequestKind(fields["kind"].decode()),
        request=fields.get("request", b""),
        header_length=int(header_length) if header_length else None,
        priority=int(fields.get("priority", b"1")),
        created_at=float(fields["created_at"]),
        status=JobStatus(fields["status"].decode()),
        started_at=number("started_at"),
        finished_at=number("finished_at"),
        attempts=int(fields.get("attempts", b"0")),
        worker=text("worker") or None,
        result=fields.get("result"),
        error=text("error"),
        webhook=text("webhook") or None,
        webhook_attempts=int(fields.get("webhook_attempts", b"0")),
        webhook_delivered=None if not delivered else delivered == b"1",
        webhook_error=text("webhook_error"),
        result_ttl_s=float(fields.get("result_ttl_s", b"3600")),
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _texts(found: dict[Any, Any]) -> dict[str, bytes]:
    """HGETALL's reply with text names."""
    return {_text(k): _bytes(v) for k, v in found.items()}


def _pairs(flat: Sequence[Any]) -> dict[str, bytes]:
    """A script's HGETALL (a flat list of names and values) as a mapping."""
    return {_text(flat[i]): _bytes(flat[i + 1]) for i in range(0, len(flat), 2)}
