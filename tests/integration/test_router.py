"""The router against real workers (child processes) on loopback: forwarding, affinity, hedging
with the loser cancelled on its worker, the hedge budget, ejection and re-admission, a worker
killed under load, shedding, deadlines, membership from a watched file, and the client library."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from support import slowable
from support.routing import running_router
from support.servers import WorkerProcess, async_wait_for, worker_process
from support.stub import StubApp, run_stub
from tailserve.client import Client, InferenceError
from tailserve.router.membership import write_members
from tailserve.router.proxy import Router

_router = running_router
# The requests that teach the hedging router a model's latency before it hedges any.
LEARNING = 20


async def _until(predicate: Callable[[], bool], what: str) -> None:
    async def check() -> bool:
        return predicate()

    await async_wait_for(check, what=what)


def _infer_body(x: float) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}
    )


async def _infer(client: httpx.AsyncClient, url: str, x: float, **kwargs: Any) -> httpx.Response:
    return await client.post(f"{url}/v2/models/m/infer", content=_infer_body(x), **kwargs)


def _y(response: httpx.Response) -> float:
    return float(response.json()["outputs"][0]["data"][0])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[WorkerProcess]]]:
    tmp = tmp_path_factory.mktemp("router-pair")
    with slowable.workers(tmp, 2) as workers:
        yield tmp, workers


async def test_forwards_requests_and_names_the_replica(pair: Any) -> None:
    _, workers = pair
    urls = [w.url for w in workers]
    async with _router(urls, max_body_bytes=4096) as router, httpx.AsyncClient() as client:
        replies = [await _infer(client, router.url, float(i)) for i in range(6)]
        assert [_y(r) for r in replies] == [2.0 * i for i in range(6)]
        assert {r.headers["x-tailserve-replica"] for r in replies} <= set(urls)
        assert (await client.get(f"{router.url}/v2/health/ready")).status_code == 200
        meta = await client.get(f"{router.url}/v2/models/m")
        assert meta.status_code == 200 and meta.json()["name"] == "m"
        # The worker's own errors pass through, naming the problem.
        unknown = await client.post(f"{router.url}/v2/models/nope/infer", content=b"{}")
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
        bad = await client.post(f"{router.url}/v2/models/m/infer", content=b"{not json")
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]
        big = await client.post(f"{router.url}/v2/models/m/infer", content=b"x" * 5000)
        assert big.status_code == 413 and "4096-byte limit" in big.json()["error"]
        # ... and the router keeps serving.
        assert _y(await _infer(client, router.url, 7.0)) == 14.0
        state = (await client.get(f"{router.url}/router/backends")).json()
        assert all(b["models"] == ["m"] and b["healthy"] for b in state["backends"])
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert 'tailserve_router_requests_total{model="m",status="200"}' in metrics


async def test_affinity_keeps_a_key_on_one_replica_and_spreads_keys(pair: Any) -> None:
    _, workers = pair
    urls = [w.url for w in workers]
    async with (
        _router(urls, balance="affinity", hedge=False) as router,
        httpx.AsyncClient() as client,
    ):
        same = {
            (await _infer(client, router.url, 3.0)).headers["x-tailserve-replica"]
            for _ in range(20)
        }
        assert len(same) == 1, router.state()
        spread = {
            (await _infer(client, router.url, float(i))).headers["x-tailserve-replica"]
            for i in range(40)
        }
        assert spread == set(urls)
        # An explicit affinity key wins over the body.
        keyed = []
        for i in range(20):
            reply = await _infer(client, router.url, float(i), headers={"x-affinity-key": "u7"})
            keyed.append(reply.headers["x-tailserve-replica"])
        assert len(set(keyed)) == 1, (keyed, router.state())


async def test_a_hedge_wins_and_the_loser_is_dropped_from_the_worker_queue(
    tmp_path: Path,
) -> None:
    async with _hedging(tmp_path, "round-robin", 1.0) as (urls, router, client):
        for i in range(LEARNING):  # learn the model's p95 (milliseconds)
            assert (await _infer(client, router.url, 100.0 + i)).status_code == 200
        before = len(slowable.ran(tmp_path, 0))
        slowable.slow(tmp_path, 0, 1.5)
        replies = await asyncio.gather(*(_infer(client, router.url, float(x)) for x in range(1, 7)))
        assert [_y(r) for r in replies] == [2.0 * x for x in range(1, 7)]
        # None waited for the slow worker: those sent to it were answered by their hedges.
        assert {r.headers["x-tailserve-replica"] for r in replies} == {urls[1]}
        hedged = [r for r in replies if r.headers.get("x-tailserve-hedged") == "1"]
        assert hedged
        # The slow worker saw its copies cancelled (499: the one it was running, at least;
        # a copy still waiting for a connection is withdrawn before it is sent) and ran at
        # most the one it had already started: the rest left its queue without running.
        await _until(lambda: _cancelled(urls[0]) >= 1, what="a cancellation on the worker")
        slowable.slow(tmp_path, 0, 0)
        assert (
            await client.post(f"{urls[0]}/v2/models/m/infer", content=_infer_body(99.0))
        ).status_code == 200
        ran_after = slowable.ran(tmp_path, 0)[before:]
        assert ran_after[-1] == 99.0
        assert len(ran_after[:-1]) <= 1, f"cancelled copies ran anyway: {ran_after}"
        state = router.state()["hedges"]
        assert isinstance(state, dict) and state["sent"] >= len(hedged)
        # The delay it hedges after now: the recent p95, slow replies included.
        assert 0.0 < state["delays_ms"]["m/s"] <= 1500.0


def _cancelled(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tailserve_requests_total{") and 'status="499"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_the_budget_caps_hedges(tmp_path: Path) -> None:
    async with _hedging(tmp_path, "round-robin", 0.1) as (_, router, client):
        for i in range(LEARNING):
            await _infer(client, router.url, float(i))
        slowable.slow(tmp_path, 0, 0.1)
        replies = await asyncio.gather(*(_infer(client, router.url, float(x)) for x in range(30)))
        assert all(r.status_code == 200 for r in replies)
        budget = router.dispatcher.hedge_budget
        # 50 requests earn 5 copies at 10%; about 15 of the 30 met the slow worker.
        assert budget.spent <= 0.1 * budget.requests + 1e-9
        assert budget.refused > 0
        metrics = (await client.get(f"{router.url}/metrics")).text
        assert 'tailserve_router_hedges_total{model="m",outcome="refused"}' in metrics


@contextlib.asynccontextmanager
async def _hedging(
    tmp: Path, balance: str, ratio: float
) -> AsyncIterator[tuple[list[str], Router, httpx.AsyncClient]]:
    """Two slowable workers behind a router that hedges once the LEARNING requests have
    answered, within ``ratio`` of the requests; yields the workers' URLs, the router and a
    client. None of the learning requests is hedged: a slow one on a loaded machine would
    otherwise have a hedge of its own, spend a token and mark its replica overtaken."""
    with slowable.workers(tmp, 2) as workers:
        urls = [w.url for w in workers]
        async with (
            _router(urls, balance=balance, hedge_min_samples=LEARNING, hedge_ratio=ratio) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            yield urls, router, client


async def _learn_keys(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    """LEARNING requests, each with an affinity key of its own (the router learns the model's
    p95 from them): answers, for each worker, a key whose requests go to it."""
    home: dict[str, str] = {}
    for i in range(LEARNING):
        reply = await _infer(client, url, 100.0 + i, headers={"x-affinity-key": f"k{i}"})
        home.setdefault(reply.headers["x-tailserve-replica"], f"k{i}")
    return home


async def test_a_hedge_that_finds_the_budget_empty_goes_out_with_the_next_token(
    tmp_path: Path,
) -> None:
    ratio = 0.04  # 20 requests earn 0.8 of a copy: the first one due finds the budget empty
    async with _hedging(tmp_path, "affinity", ratio) as (urls, router, client):
        home = await _learn_keys(client, router.url)
        slow_key, fast_key = home[urls[0]], home[urls[1]]
        dispatcher = router.dispatcher
        late = dispatcher.late_hedges
        slowable.slow(tmp_path, 0, 3.0)
        stuck = asyncio.ensure_future(
            _infer(client, router.url, 1.0, headers={"x-affinity-key": slow_key})
        )
        await _until(
            lambda: dispatcher.hedges_waiting == 1,
            what="the stuck request's hedge to wait for a token",
        )
        assert dispatcher.hedge_budget.refused >= 1 and dispatcher.late_hedges == late
        earning = 0
        while not stuck.done() and earning < 40:  # each request earns 0.04 of a token
            reply = await _infer(
                client, router.url, 50.0 + earning, headers={"x-affinity-key": fast_key}
            )
            assert reply.status_code == 200
            earning += 1
        reply = await stuck
        # The late hedge answered before the 3 s reply.
        assert reply.status_code == 200 and reply.headers.get("x-tailserve-hedged") == "1"
        assert reply.headers["x-tailserve-replica"] == urls[1]
        assert dispatcher.late_hedges == late + 1 and dispatcher.hedges_waiting == 0
        # It waited for the token the requests after it earned: the budget still holds.
        budget = dispatcher.hedge_budget
        assert budget.spent <= ratio * budget.requests + 1e-9
        slowable.slow(tmp_path, 0, 0)


async def test_a_rationed_hedge_goes_out_when_overdue_with_no_new_requests(
    tmp_path: Path,
) -> None:
    # 20 requests at 15% earn 3 copies: below half the cap (10), so a hedge is rationed and
    # waits until the request has had no reply for the p99; nothing else comes meanwhile.
    async with _hedging(tmp_path, "affinity", 0.15) as (urls, router, client):
        home = await _learn_keys(client, router.url)
        dispatcher = router.dispatcher
        assert 1.0 <= dispatcher.hedge_budget.tokens < 5.0
        late = dispatcher.late_hedges
        slowable.slow(tmp_path, 0, 3.0)
        reply = await _infer(client, router.url, 1.0, headers={"x-affinity-key": home[urls[0]]})
        # The rationed hedge went out when overdue and answered before the 3 s reply.
        assert reply.status_code == 200 and reply.headers.get("x-tailserve-hedged") == "1"
        assert reply.headers["x-tailserve-replica"] == urls[1]
        assert dispatcher.hedge_budget.refused >= 1 and dispatcher.late_hedges == late + 1
        slowable.slow(tmp_path, 0, 0)


async def test_a_replica_that_keeps_losing_to_hedges_has_its_late_requests_hedged_at_once(
    tmp_path: Path,
) -> None:
    # Rationed as in the test above: the first stuck request on worker 0 waits for the p99.
    # Its hedge wins, so worker 0 has lost to a hedge where worker 1 never has: suspect. Its
    # next stuck request is hedged at its delay (the p95), not made to wait for the p99.
    async with _hedging(tmp_path, "affinity", 0.15) as (urls, router, client):
        home = await _learn_keys(client, router.url)
        dispatcher = router.dispatcher
        pool = dispatcher.pool_for("m")
        first = next(b for b in pool if b.url == urls[0])
        assert not pool.suspect(first)
        slowable.slow(tmp_path, 0, 3.0)
        stuck = {"x-affinity-key": home[urls[0]]}
        late, suspect = dispatcher.late_hedges, dispatcher.suspect_hedges
        reply = await _infer(client, router.url, 1.0, headers=stuck)
        assert reply.headers.get("x-tailserve-hedged") == "1"
        assert dispatcher.late_hedges == late + 1 and dispatcher.suspect_hedges == suspect
        assert pool.suspect(first), first.overtaken
        assert 1.0 <= dispatcher.hedge_budget.tokens < 5.0  # still rationed, a token there
        reply = await _infer(client, router.url, 2.0, headers=stuck)
        assert reply.status_code == 200 and reply.headers.get("x-tailserve-hedged") == "1"
        assert _y(reply) == 4.0
        assert dispatcher.suspect_hedges == suspect + 1 and dispatcher.late_hedges == late + 1
        state = (await client.get(f"{router.url}/router/backends")).json()
        assert state["hedges"]["suspect"] == suspect + 1
        shares = {b["id"]: b["overtaken"] for b in state["backends"]}
        assert shares[first.id] > 0.0
        slowable.slow(tmp_path, 0, 0)


async def test_a_failing_backend_is_ejected_then_readmitted() -> None:
    good, bad = StubApp(), StubApp(status=500)
    with run_stub(good) as g, run_stub(bad) as b:
        async with (
            _router(
                [g.url, b.url],
                balance="round-robin",
                hedge=False,
                eject_after_failures=3,
                eject_base_s=0.5,
            ) as router,
            httpx.AsyncClient() as client,
        ):
            statuses = [(await _infer(client, router.url, 1.0)).status_code for _ in range(12)]
            assert statuses.count(500) == 3  # then it is out
            assert statuses[-4:] == [200] * 4
            ejected = router.dispatcher.upstreams[b.url].backend
            assert ejected.ejections == 1
            bad.status = 200
            await _until(
                lambda: not ejected.is_ejected(router.loop.time()), what="the backoff to end"
            )
            replicas = {
                (await _infer(client, router.url, 1.0)).headers["x-tailserve-replica"]
                for _ in range(4)
            }
            assert replicas == {g.url, b.url}
            metrics = (await client.get(f"{router.url}/metrics")).text
            assert "tailserve_router_ejections_total" in metrics


async def test_a_client_cannot_get_healthy_replicas_ejected() -> None:
    # A deadline shorter than any replica answers in, and a 503 about one model (not loaded,
    # its feature store down), say nothing of the replica's health; a replica that sits on a
    # request for many times its usual reply time does.
    slow, unavailable = StubApp(service_s=0.05), StubApp(status=503)
    with run_stub(slow) as s, run_stub(unavailable) as u:
        async with (
            _router(
                [s.url, u.url],
                balance="round-robin",
                hedge=False,
                eject_after_failures=3,
            ) as router,
            httpx.AsyncClient() as client,
        ):
            backends = {url: router.dispatcher.upstreams[url].backend for url in (s.url, u.url)}
            unavailable.status = 200
            for _ in range(4):  # the slow one's usual reply time: 50 ms
                assert (await _infer(client, router.url, 1.0)).status_code == 200
            unavailable.status = 503
            hurried = [
                (await _infer(client, router.url, 1.0, headers={"x-deadline-ms": "2"})).status_code
                for _ in range(12)
            ]
            assert 504 in hurried and 503 in hurried, hurried
            assert not any(b.ejections for b in backends.values())
            slow.stall_after, slow.stall_s = len(slow.arrivals) + 1, 5.0  # it hangs now
            for _ in range(8):
                await _infer(client, router.url, 1.0, headers={"x-deadline-ms": "400"})
            assert backends[s.url].ejections == 1  # 400 ms is eight times its 50 ms
            assert backends[u.url].ejections == 0


async def test_a_worker_killed_under_load_fails_no_request(tmp_path: Path) -> None:
    with slowable.workers(tmp_path, 2) as workers:
        urls = [w.url for w in workers]
        # Latency ejection off: this is about retries. With both slowed alike, p2c still
        # steered most requests to one, the other's average went stale at 3x, and it was
        # ejected before the kill, leaving only the worker about to die (one run in a few).
        async with (
            _router(urls, eject_latency_factor=0) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            for i in range(100):  # the retry budget is earned by traffic
                await _infer(client, router.url, float(i))
            slowable.slow(tmp_path, 0, 0.05)
            slowable.slow(tmp_path, 1, 0.05)
            backend = router.dispatcher.upstreams[urls[0]].backend
            killed = asyncio.Event()
            statuses: list[int] = []

            async def user(offset: int) -> None:
                for i in range(40):
                    reply = await _infer(client, router.url, float(offset + i))
                    statuses.append(reply.status_code)
                    # Killed with requests in flight to it, once some traffic has gone by.
                    if len(statuses) >= 40 and backend.in_flight and not killed.is_set():
                        os.kill(workers[0].process.pid, signal.SIGKILL)
                        killed.set()

            await asyncio.gather(*(user(1000 * u) for u in range(4)))
            assert killed.is_set()
            assert statuses == [200] * 160, f"failed: {[s for s in statuses if s != 200]}"
            retried = router.dispatcher.retry_budget.spent
            assert retried >= 1
            await _until(lambda: not backend.in_service(router.loop.time()), "the dead one out")


async def test_requests_are_shed_at_once_when_every_replica_is_saturated(tmp_path: Path) -> None:
    with slowable.workers(tmp_path, 1) as workers:
        slowable.slow(tmp_path, 0, 3.0)
        async with (
            _router([workers[0].url], max_in_flight=1, hedge=False) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            slow = asyncio.ensure_future(_infer(client, router.url, 1.0))
            await _until(lambda: router.dispatcher.backends[0].in_flight == 1, what="one in flight")
            shed = await _infer(client, router.url, 2.0)
            assert not slow.done(), "the shed request waited for the 3 s reply"
            assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
            assert "in-flight limit" in shed.json()["error"]
            assert (await slow).status_code == 200
        slowable.slow(tmp_path, 0, 0)


async def test_the_deadline_left_is_propagated() -> None:
    stub = StubApp()
    with run_stub(stub) as s:
        async with _router([s.url], hedge=False) as router, httpx.AsyncClient() as client:
            await _infer(client, router.url, 1.0, headers={"x-deadline-ms": "800"})
            await _infer(client, router.url, 1.0)
    infers = [a for a in stub.arrivals if a.path.endswith("/infer")]
    left = float(infers[0].headers["x-deadline-ms"])
    assert 700 < left <= 800
    assert "x-deadline-ms" not in infers[1].headers


async def test_once_started_the_router_keeps_what_it_holds_out_of_full_collections() -> None:
    # Frozen objects are skipped by every collection: without the freeze a full one walked
    # the router's modules and stalled the requests in flight for 16-22 ms.
    gc.unfreeze()
    with run_stub(StubApp()) as s:
        async with _router([s.url], hedge=False):
            assert gc.get_freeze_count() > 0


async def test_membership_follows_a_watched_file(pair: Any, tmp_path: Path) -> None:
    _, workers = pair
    members = tmp_path / "backends.txt"
    write_members(members, [workers[0].url])
    async with (
        _router([], backends_file=str(members), file_interval_s=0.05) as router,
        httpx.AsyncClient() as client,
    ):
        assert [b.id for b in router.dispatcher.backends] == [workers[0].url]
        write_members(members, [workers[0].url, workers[1].url])
        await _until(lambda: len(router.dispatcher.backends) == 2, what="2nd backend")
        await _until(lambda: all(b.healthy for b in router.dispatcher.backends), what="its check")
        write_members(members, [workers[1].url])
        await _until(lambda: len(router.dispatcher.backends) == 1, what="a backend left")
        replicas = {
            (await _infer(client, router.url, 1.0)).headers["x-tailserve-replica"] for _ in range(6)
        }
        assert replicas == {workers[1].url}


async def test_the_client_library_applies_the_policies_in_process(pair: Any) -> None:
    _, workers = pair
    urls = [w.url for w in workers]
    async with Client(urls, balance="affinity", health_interval_s=0.1) as client:
        result = await client.infer("m", {"x": np.array([[1.5]], dtype=np.float32)})
        assert result.outputs["y"].tolist() == [[3.0]]
        assert result.replica in urls
        again = await client.infer("m", {"x": np.array([[1.5]], dtype=np.float32)})
        assert again.replica == result.replica
        with pytest.raises(InferenceError, match="404") as error:
            await client.infer("nope", {"x": np.array([[1.0]], dtype=np.float32)})
        assert error.value.status == 404
        meta = await client.request("GET", "/v2/models/m", model="m")
        assert meta.status == 200 and orjson.loads(meta.body)["name"] == "m"


async def test_expect_continue_head_and_keep_alive_on_a_raw_connection(pair: Any) -> None:
    _, workers = pair
    async with _router([w.url for w in workers], hedge=False) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        body = _infer_body(2.0)
        writer.write(
            b"POST /v2/models/m/infer HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n"
            b"expect: 100-continue\r\n\r\n" % len(body)
        )
        # The body goes only once the router has said to go on.
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK")
        reply = await reader.readexactly(_length(head))
        assert orjson.loads(reply)["outputs"][0]["data"] == [4.0]
        # HEAD: the head GET would send, with its length, and no body.
        writer.write(b"HEAD /v2/models/m HTTP/1.1\r\nhost: r\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK") and _length(head) > 0
        # ... so the next reply on the connection is the next request's.
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nhost: r\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK") and _length(head) == 0
        writer.close()


async def test_a_request_shed_behind_a_pipelined_one_leaves_the_next_one_cancellable(
    tmp_path: Path,
) -> None:
    # Worker 0 serves model a, worker 1 model b; each takes one request at a time. With a's
    # one slot taken, a raw connection pipelines b (2 s), a (shed at once when its turn
    # comes) and b again, which goes out from within the shed request's handling. Closing the
    # connection while that b runs must cancel it on its worker, not the shed one.
    with contextlib.ExitStack() as stack:
        urls = []
        for i, model in enumerate("ab"):
            root = slowable.repository(tmp_path / f"repo{i}", model)
            urls.append(stack.enter_context(worker_process(root, tmp_path)).url)
            slowable.slow(tmp_path, i, 2.0 if model == "b" else 8.0, model)
        async with (
            _router(urls, max_in_flight=1, hedge=False) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):

            def indexed() -> bool:
                return all(u.models is not None for u in router.dispatcher.upstreams.values())

            await _until(indexed, what="both model indexes")
            holding = asyncio.ensure_future(
                client.post(f"{router.url}/v2/models/a/infer", content=_infer_body(1.0))
            )
            await _until(lambda: router.dispatcher.backends[0].in_flight == 1, what="a's slot")
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            body = _infer_body(2.0)
            head = b"HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
            pipelined = [b"POST /v2/models/%s/infer " % m + head + body for m in (b"b", b"a", b"b")]
            writer.write(b"".join(pipelined))
            for status in (b"200", b"503"):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 " + status), head
                await reader.readexactly(_length(head))
            await _until(lambda: router.dispatcher.backends[1].in_flight == 1, what="b again")
            writer.close()
            await _until(lambda: _cancelled(urls[1]) >= 1, what="b cancelled on its worker")
            holding.cancel()
        slowable.slow(tmp_path, 0, 0, "a")


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise AssertionError(f"no content-length in {head!r}")


async def test_sampled_decisions_say_why_a_replica_was_chosen(
    pair: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, workers = pair
    urls = [w.url for w in workers]
    caplog.set_level("INFO", logger="tailserve.router.decisions")
    async with (
        _router(urls, balance="affinity", hedge=False, decision_sample=1.0) as router,
        httpx.AsyncClient() as client,
    ):
        reply = await _infer(client, router.url, 5.0)
    records = [
        orjson.loads(r.getMessage())
        for r in caplog.records
        if r.name == "tailserve.router.decisions"
    ]
    assert len(records) == 1
    decision = records[0]
    assert decision["chosen"] == reply.headers["x-tailserve-replica"]
    assert decision["policy"] == "affinity" and decision["kind"] == "first"
    assert decision["home"] == decision["chosen"] and decision["spilled"] is False
    assert set(decision["replicas"]) == set(urls)
