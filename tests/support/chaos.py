"""The chaos suite's core: steady open-loop load on a real stack while faults are applied one
after the other, and what each did to the requests sent meanwhile.

The stack is `tailserve up` (the example repository, a real redis-server as ``--redis-url``),
the load comes through the client library (`tailserve.client.Client`, with its retries) at a
fixed rate, half repeated keys (cache hits) and half unique inputs. Every request ends as one
of: ``ok`` (200), ``failed`` (another status, or an error, after the client's retries) or
``lost`` (no answer within ``lost_after_s``). The faults:

- ``worker-kill``: SIGKILL a worker, ``kills`` times, ``kill_every_s`` apart (a random worker
  among those ready, so that one always is: the supervisor restarts the other);
- ``redis-restart``: stop Redis, leave it down ``redis_down_s``, start it on its port again;
- ``worker-stop``: SIGSTOP a worker for ``stop_s``, then SIGCONT;
- ``frontdoor-kill``: SIGKILL HAProxy (master and worker); the supervisor starts it again.

For each: the requests sent (by intended send time) from the fault until the next one began,
how many failed or were lost, and the seconds to recover: from the fault (its last kill) to the
first of three good seconds in a row (every request ok, and the second's p99 within the SLO,
or within the worst second of the baseline before any fault when that was worse) once the
fault is over (Redis started again, the worker continued).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from support.servers import OwnRedisServer, own_redis_server, start_redis, stop_redis
from support.up import UpProcess, tailserve_up
from tailserve.client import Client
from tailserve.examples.churn import FIELDS, sample_rows

MODEL = "churn"
SLO_S = 0.050
# Recovered: the first of this many good seconds in a row (on a shared machine a second now and
# then misses the SLO with no fault at all).
SETTLE_S = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosPlan:
    rate: float = 200.0
    warmup_s: float = 3.0  # load before the baseline is measured
    baseline_s: float = 10.0
    quiet_s: float = 10.0  # after each fault, before the next
    kills: int = 5
    kill_every_s: float = 2.0
    redis_down_s: float = 3.0
    stop_s: float = 2.0
    lost_after_s: float = 10.0
    hot_keys: int = 64
    hot_share: float = 0.5
    seed: int = 7
    # A second is good when its p99 is within this (or the baseline's worst second, if worse).
    bar_s: float = SLO_S
    faults: tuple[str, ...] = ("worker-kill", "redis-restart", "worker-stop", "frontdoor-kill")


@dataclass(slots=True)
class Sent:
    at: float  # intended send time, seconds since the load began
    latency_s: float = math.nan
    outcome: str = "pending"  # ok, failed, lost
    why: str = ""


@dataclass(slots=True)
class FaultRow:
    fault: str
    sent: int
    failed: int
    lost: int
    recover_s: float | None
    started_at: float
    blow_at: float
    ended_at: float
    p99_ms: float
    why: dict[str, int] = field(default_factory=dict)
    # From the fault's last blow, a second at a time: [sent, not ok, p99 in ms].
    seconds: list[list[float]] = field(default_factory=list)


@dataclass(slots=True)
class ChaosResult:
    plan: ChaosPlan
    baseline: FaultRow
    rows: list[FaultRow]

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": asdict(self.plan),
            "baseline": asdict(self.baseline),
            "faults": [asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        lines = [
            "| fault | requests sent | failed | lost | seconds to recover | p99 in window (ms) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in [self.baseline, *self.rows]:
            recover = "-" if row.fault == "baseline" else _recover_text(row.recover_s)
            lines.append(
                f"| {row.fault} | {row.sent} | {row.failed} | {row.lost} | {recover} "
                f"| {row.p99_ms:.1f} |"
            )
        return "\n".join(lines)


def _recover_text(value: float | None) -> str:
    return "not within the window" if value is None else f"{value:.1f}"


# --- the stack -----------------------------------------------------------------------------


@dataclass(slots=True)
class Stack:
    up: UpProcess
    redis: OwnRedisServer

    @property
    def url(self) -> str:
        return self.up.url

    def ready_workers(self) -> list[int]:
        """The pids of the workers the fleet says are ready now."""
        fleet = httpx.get(f"{self.url}/v2/fleet", timeout=5.0).json()
        return [w["pid"] for w in fleet["workers"] if w["ready"] and w["pid"]]

    def front_door_pid(self) -> int:
        return self.up.front_door_pids()[-1]


def churn_repository(examples: Path, into: Path) -> Path:
    """A repository of the example repository's churn model alone: a worker killed again and
    again restarts in a second or two, not the half minute the text models take to load."""
    shutil.copytree(examples / MODEL, into / MODEL)
    return into


@contextlib.contextmanager
def chaos_stack(repository: Path, workdir: Path, *extra: str) -> Iterator[Stack]:
    """`tailserve up` with two workers and a redis-server of its own as its L2."""
    with (
        own_redis_server(workdir) as redis,
        tailserve_up(repository, workdir, "--workers", "2", "--redis-url", redis.url, *extra) as up,
    ):
        yield Stack(up, redis)


# --- the load ------------------------------------------------------------------------------


def _inputs(rows: dict[str, list[Any]], i: int) -> dict[str, np.ndarray[Any, Any]]:
    out: dict[str, np.ndarray[Any, Any]] = {}
    for f in FIELDS:
        value = rows[f.name][i]
        if f.datatype == "BYTES":
            out[f.name] = np.array([[str(value).encode()]], dtype=object)
        elif f.datatype.startswith("FP"):
            out[f.name] = np.array([[value]], dtype=np.float32)
        else:
            out[f.name] = np.array([[value]], dtype=np.int64)
    return out


class Load:
    """Open-loop requests at ``plan.rate`` until `stop`: each is sent at its intended time
    whatever the others do, and recorded."""

    def __init__(self, client: Client, plan: ChaosPlan, expected_s: float) -> None:
        self.client = client
        self.plan = plan
        self.rng = random.Random(plan.seed)
        hot = sample_rows(plan.hot_keys, plan.seed)
        self.hot = [_inputs(hot, i) for i in range(plan.hot_keys)]
        self.unique = sample_rows(int(plan.rate * expected_s * 1.5) + 100, plan.seed + 1)
        self.next_unique = 0
        self.sent: list[Sent] = []
        self.started = 0.0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def now(self) -> float:
        return time.monotonic() - self.started

    async def run(self) -> None:
        self.started = time.monotonic()
        interval = 1.0 / self.plan.rate
        i = 0
        while not self._stop.is_set():
            due = i * interval
            delay = due - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            record = Sent(due)
            self.sent.append(record)
            task = asyncio.create_task(self._one(record, self._pick()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            i += 1

    def _pick(self) -> dict[str, np.ndarray[Any, Any]]:
        if self.rng.random() < self.plan.hot_share:
            return self.hot[self.rng.randrange(len(self.hot))]
        index = self.next_unique % len(self.unique[FIELDS[0].name])
        self.next_unique += 1
        return _inputs(self.unique, index)

    async def _one(self, record: Sent, inputs: dict[str, np.ndarray[Any, Any]]) -> None:
        try:
            async with asyncio.timeout(self.plan.lost_after_s):
                await self.client.infer(MODEL, inputs)
            record.outcome = "ok"
        except TimeoutError:
            record.outcome, record.why = "lost", "no answer"
        except Exception as exc:  # every failure is counted, by its words
            record.outcome, record.why = "failed", str(exc)[:80]
        record.latency_s = self.now() - record.at

    async def stop(self, runner: asyncio.Task[None]) -> None:
        """Stop sending (``runner``: `run`'s task) and wait for every request sent to end
        (answered or lost)."""
        self._stop.set()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


# --- the faults ----------------------------------------------------------------------------


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


async def _ready_worker(stack: Stack, rng: random.Random) -> int:
    """A random ready worker's pid, waiting while none is ready but one."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        ready = await asyncio.to_thread(stack.ready_workers)
        if len(ready) == 2:
            return rng.choice(ready)
        await asyncio.sleep(0.1)
    fleet = await asyncio.to_thread(httpx.get, f"{stack.url}/v2/fleet", timeout=5.0)
    raise RuntimeError(f"the fleet did not have both workers ready within 30 s: {fleet.text}")


async def kill_workers(stack: Stack, plan: ChaosPlan, rng: random.Random) -> None:
    for i in range(plan.kills):
        if i:
            await asyncio.sleep(plan.kill_every_s)
        _signal(await _ready_worker(stack, rng), signal.SIGKILL)


async def restart_redis(stack: Stack, plan: ChaosPlan, rng: random.Random) -> None:
    await asyncio.to_thread(stop_redis, stack.redis.process)
    await asyncio.sleep(plan.redis_down_s)
    redis = stack.redis
    redis.process = await asyncio.to_thread(start_redis, redis.port, redis.workdir)


async def stop_worker(stack: Stack, plan: ChaosPlan, rng: random.Random) -> None:
    pid = await _ready_worker(stack, rng)
    _signal(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(plan.stop_s)
    finally:
        _signal(pid, signal.SIGCONT)


async def kill_front_door(stack: Stack, plan: ChaosPlan, rng: random.Random) -> None:
    # HAProxy's master and its worker share a session and group of their own.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(stack.front_door_pid(), signal.SIGKILL)


Fault = Callable[[Stack, ChaosPlan, random.Random], Awaitable[None]]
FAULTS: dict[str, Fault] = {
    "worker-kill": kill_workers,
    "redis-restart": restart_redis,
    "worker-stop": stop_worker,
    "frontdoor-kill": kill_front_door,
}
# Where recovery is counted from: the fault's start, or its end (the last kill).
FROM_END = {"worker-kill"}


# --- the run -------------------------------------------------------------------------------


async def run_chaos(
    stack: Stack, plan: ChaosPlan, echo: Callable[[str], None] = print
) -> ChaosResult:
    """Drive the load, apply each of ``plan.faults`` in turn, and judge the windows."""
    unknown = [f for f in plan.faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}: expected some of {', '.join(FAULTS)}")
    expected = plan.warmup_s + plan.baseline_s + len(plan.faults) * (plan.quiet_s + 12.0)
    rng = random.Random(plan.seed)
    # The front door stands for the whole fleet: the client's in-flight bound is its, not one
    # worker's.
    async with Client([stack.url], timeout_s=plan.lost_after_s * 2, max_in_flight=4096) as client:
        load = Load(client, plan, expected)
        runner = asyncio.create_task(load.run())
        try:
            await asyncio.sleep(plan.warmup_s + plan.baseline_s)
            marks: list[tuple[str, float, float, float]] = []
            for name in plan.faults:
                start = load.now()
                echo(f"{start:6.1f} s  {name}")
                await FAULTS[name](stack, plan, rng)
                end = load.now()
                marks.append((name, start, end if name in FROM_END else start, end))
                await asyncio.sleep(plan.quiet_s)
        finally:
            await load.stop(runner)
    ended = load.now()
    baseline = judge(
        "baseline",
        load.sent,
        plan.warmup_s,
        plan.warmup_s,
        plan.warmup_s + plan.baseline_s,
        math.inf,
    )
    bar = max(
        plan.bar_s, baseline_worst_p99(load.sent, plan.warmup_s, plan.warmup_s + plan.baseline_s)
    )
    rows = []
    for i, (name, start, blow, end) in enumerate(marks):
        until = marks[i + 1][1] if i + 1 < len(marks) else ended
        rows.append(judge(name, load.sent, start, blow, until, bar, over_at=end))
    return ChaosResult(plan, baseline, rows)


def _p99(latencies: list[float]) -> float:
    if not latencies:
        return 0.0
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _seconds(sent: list[Sent], start: float, until: float) -> list[list[Sent]]:
    bins: list[list[Sent]] = [[] for _ in range(max(1, math.ceil(until - start)))]
    for record in sent:
        if start <= record.at < until:
            bins[min(len(bins) - 1, int(record.at - start))].append(record)
    return bins


def baseline_worst_p99(sent: list[Sent], start: float, until: float) -> float:
    return max(
        (_p99([r.latency_s for r in b]) for b in _seconds(sent, start, until) if b), default=0.0
    )


def judge(
    name: str,
    sent: list[Sent],
    start: float,
    blow: float,
    until: float,
    bar_s: float,
    over_at: float | None = None,
) -> FaultRow:
    """The window of a fault from ``start`` until ``until`` (the next one's start), its
    recovery counted from ``blow``: the first of `SETTLE_S` good seconds in a row that begins
    once the fault is over (``over_at``: Redis started again, the worker continued)."""
    window = [r for r in sent if start <= r.at < until]
    why: dict[str, int] = {}
    for r in window:
        if r.outcome != "ok":
            why[r.why] = why.get(r.why, 0) + 1
    bins = _seconds(sent, blow, until)
    # (A request still in flight when the next fault began is that fault's to judge.)
    judged = [[r for r in b if r.outcome != "ok" or r.at + r.latency_s < until] for b in bins]
    good = [
        all(r.outcome == "ok" for r in b) and _p99([r.latency_s for r in b]) <= bar_s
        for b in judged
    ]
    recover: float | None = None
    for i in range(int((over_at or blow) - blow), len(good)):
        if all(good[i : i + SETTLE_S]):
            recover = float(i)
            break
    return FaultRow(
        fault=name,
        sent=len(window),
        failed=sum(r.outcome == "failed" for r in window),
        lost=sum(r.outcome == "lost" for r in window),
        recover_s=recover,
        started_at=round(start, 3),
        blow_at=round(blow, 3),
        ended_at=round(until, 3),
        p99_ms=_p99([r.latency_s for r in window if r.outcome == "ok"]) * 1e3,
        why=why,
        seconds=[
            [
                len(b),
                sum(r.outcome != "ok" for r in b),
                round(_p99([r.latency_s for r in b]) * 1e3, 1),
            ]
            for b in bins
        ],
    )
