"""The dispatcher's policies end to end (hedging, retries, ejection, shedding, deadlines), each
test run twice: over the in-process transport (transport/in_memory.py) and over loopback HTTP
to the worker's own server. Replicas hold a request until the test releases it, so nothing
here waits on a guess of how long something takes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from support.replicas import InMemory, Loopback, Replica, Replicas
from support.servers import async_wait_for
from tailserve.router.config import RouterConfig
from tailserve.router.dispatch import Dispatcher
from tailserve.router.messages import Outcome, request_framer

PATH = "/v2/models/m/infer"


@pytest.fixture(params=["memory", "loopback"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[Replicas]:
    where: Replicas = InMemory() if request.param == "memory" else Loopback()
    yield where
    await where.close()


async def dispatcher(
    replicas: Replicas, count: int, **config: Any
) -> tuple[Dispatcher, list[Replica], list[str]]:
    """A dispatcher in front of ``count`` replicas (a, b, ...), all taken as healthy."""
    members = [Replica("abcd"[i]) for i in range(count)]
    urls = [await replicas.start(m) for m in members]
    d = Dispatcher(RouterConfig(backends=tuple(urls), **config), connect=replicas.connect)
    d.set_members(urls, healthy=True)
    return d, members, urls


async def infer(
    d: Dispatcher,
    x: float,
    *,
    key: str | None = None,
    deadline_s: float | None = None,
    idempotent: bool = True,
) -> Outcome:
    body = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "data": [x]}]})
    frame = request_framer("POST", PATH, body, [("content-type", "application/json")])
    return await d.request(
        "m", frame, key=key, deadline_s=deadline_s, idempotent=idempotent, hedge=idempotent
    )


async def until(predicate: Callable[[], bool], what: str) -> None:
    async def check() -> bool:
        return predicate()

    await async_wait_for(check, timeout_s=10, what=what)


async def homes(d: Dispatcher, urls: list[str], *, requests: int = 10) -> dict[str, str]:
    """An affinity key whose requests go to each replica, found in ``requests`` requests (or
    as many more as it takes)."""
    home: dict[str, str] = {}
    for i in range(100):
        if i >= requests and len(home) == len(urls):
            return home
        outcome = await infer(d, float(i), key=f"k{i}")
        assert outcome.backend is not None
        home.setdefault(outcome.backend, f"k{i}")
    raise AssertionError(f"100 keys found homes on {sorted(home)} only")


async def test_a_request_reaches_a_replica_with_the_deadline_it_has_left(
    replicas: Replicas,
) -> None:
    d, members, urls = await dispatcher(replicas, 2, balance="round-robin", hedge=False)
    try:
        first = await infer(d, 1.5, deadline_s=0.8)
        second = await infer(d, 2.5)
        assert (first.status, second.status) == (200, 200)
        assert {first.backend, second.backend} == set(urls)  # round-robin: one each
        assert orjson.loads(first.body)["inputs"][0]["data"] == [1.5]
        (a,), (b,) = (m.seen for m in members)
        sent_first = a if a.raw_body == first.body else b
        left = float(sent_first.header(b"x-deadline-ms") or b"0")
        assert 0 < left <= 800
        other = b if sent_first is a else a
        assert other.header(b"x-deadline-ms") is None
    finally:
        await d.close()


async def test_a_hedge_wins_and_the_loser_is_withdrawn_from_its_replica(
    replicas: Replicas,
) -> None:
    d, (a, _b), urls = await dispatcher(
        replicas, 2, balance="round-robin", hedge_min_samples=5, hedge_ratio=1.0
    )
    try:
        for i in range(10):  # the model's p95: a few ms at most
            assert (await infer(d, float(i))).status == 200
        a.hold()
        outcomes = await asyncio.gather(*(infer(d, float(x)) for x in range(6)))
        assert [o.status for o in outcomes] == [200] * 6
        assert [orjson.loads(o.body)["inputs"][0]["data"] for o in outcomes] == [
            [float(x)] for x in range(6)
        ]
        hedged = [o for o in outcomes if o.hedged]
        assert len(hedged) == 3 and all(o.backend == urls[1] for o in hedged)
        # Each copy a held was cancelled on it: its client (the router) went away.
        for _ in hedged:
            cancelled = await asyncio.wait_for(a.cancelled.get(), 5)
            assert cancelled.disconnected
        # (A copy to b may have been hedged too, on a slow turn of a loaded machine.)
        assert d.hedge_budget.spent >= 3
    finally:
        a.release()
        await d.close()


async def test_the_budget_caps_hedges_and_a_refused_one_waits_for_a_token(
    replicas: Replicas,
) -> None:
    ratio = 0.02
    d, (a, _b), urls = await dispatcher(
        replicas, 2, balance="affinity", hedge_min_samples=5, hedge_ratio=ratio
    )
    try:
        home = await homes(d, urls)  # ~10 requests earn 0.2 of a token
        assert d.hedge_budget.tokens < 1.0
        spent = d.hedge_budget.spent
        a.hold()
        stuck = asyncio.ensure_future(infer(d, 1.0, key=home[urls[0]]))
        await until(lambda: d.hedges_waiting == 1, "the stuck request's hedge to wait")
        assert d.hedge_budget.refused >= 1 and not stuck.done()
        # The requests after it earn the token it waits for; once overdue, it goes.
        earned = 0
        while not stuck.done() and earned < 200:
            assert (await infer(d, 50.0, key=home[urls[1]])).status == 200
            earned += 1
        outcome = await stuck
        assert outcome.hedged and outcome.backend == urls[1]
        budget = d.hedge_budget
        assert budget.spent == spent + 1 and budget.spent <= ratio * budget.requests + 1e-9
        assert d.hedges_waiting == 0
    finally:
        a.release()
        await d.close()


async def test_a_request_whose_replica_dies_is_retried_on_another_if_idempotent(
    replicas: Replicas,
) -> None:
    d, (a, _b), urls = await dispatcher(replicas, 2, balance="affinity", hedge=False)
    try:
        key = (await homes(d, urls))[urls[0]]
        a.hold()
        safe = asyncio.ensure_future(infer(d, 1.0, key=key))
        unsafe = asyncio.ensure_future(infer(d, 2.0, key=key, idempotent=False))
        for _ in range(2):
            await asyncio.wait_for(a.arrivals.get(), 5)
        replicas.kill(urls[0])
        retried, lost = await safe, await unsafe
        assert retried.status == 200 and retried.backend == urls[1] and retried.attempts == 2
        # Sent, then lost: it may have run, so it is not sent again.
        assert lost.status == 502 and lost.reason == "upstream" and lost.attempts == 1
        assert d.retry_budget.spent == 1
        # A refused connection sent nothing: any request is retried.
        refused = await infer(d, 3.0, key=key, idempotent=False)
        assert refused.status == 200 and refused.backend == urls[1] and refused.attempts == 2
        assert d.retry_budget.spent == 2
    finally:
        await d.close()


async def test_a_refusal_429_is_retried_on_another_replica(replicas: Replicas) -> None:
    d, (a, b), urls = await dispatcher(replicas, 2, balance="affinity", hedge=False)
    try:
        home = await homes(d, urls)
        a.status = 429
        outcome = await infer(d, 1.0, key=home[urls[0]])
        assert outcome.status == 200 and outcome.backend == urls[1] and outcome.attempts == 2
        b.status = 429  # none left to try: the worker's 429 is passed on
        passed = await infer(d, 1.0, key=home[urls[0]])
        assert passed.status == 429 and b"says 429" in passed.body
    finally:
        await d.close()


async def test_a_failing_replica_is_ejected_after_its_failures_in_a_row(
    replicas: Replicas,
) -> None:
    d, (a, _b), urls = await dispatcher(
        replicas, 2, balance="round-robin", hedge=False, eject_after_failures=3
    )
    try:
        a.status = 500
        statuses = [(await infer(d, 1.0)).status for _ in range(12)]
        assert statuses.count(500) == 3 and statuses[-4:] == [200] * 4
        failing = d.upstreams[urls[0]].backend
        assert failing.ejections == 1 and failing.is_ejected(d.loop.time())
        assert d.upstreams[urls[1]].backend.ejections == 0
    finally:
        await d.close()


async def test_requests_are_shed_at_once_when_every_replica_is_full(replicas: Replicas) -> None:
    d, (a,), _ = await dispatcher(replicas, 1, hedge=False, max_in_flight=1)
    try:
        a.hold()
        first = asyncio.ensure_future(infer(d, 1.0))
        await asyncio.wait_for(a.arrivals.get(), 5)
        shed = await infer(d, 2.0)
        assert shed.status == 503 and shed.reason == "saturated"
        assert (b"retry-after", b"1") in shed.headers
        assert not first.done()
        a.release()
        assert (await first).status == 200
    finally:
        await d.close()


async def test_a_deadline_that_runs_out_answers_504_and_withdraws_the_request(
    replicas: Replicas,
) -> None:
    d, (a,), _ = await dispatcher(replicas, 1, hedge=False)
    try:
        a.hold()
        late = await infer(d, 1.0, deadline_s=0.05)
        assert late.status == 504 and late.reason == "upstream"
        cancelled = await asyncio.wait_for(a.cancelled.get(), 5)
        assert cancelled.disconnected
        # A deadline shorter than the replica's usual time says nothing of its health.
        assert d.upstreams[d.backends[0].id].backend.ejections == 0
    finally:
        a.release()
        await d.close()
