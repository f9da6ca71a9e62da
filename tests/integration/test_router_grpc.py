"""The router's gRPC front against real workers (child processes) on loopback: OIP gRPC calls
sent on over HTTP with the router's policies (replica choice, hedging, shedding, deadlines),
health and metadata, and errors as gRPC statuses that name the problem."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from support import slowable
from support.routing import running_router
from support.servers import WorkerProcess, async_wait_for, free_port
from support.stub import StubApp, run_stub
from tailserve.protocols.grpc import schema
from tailserve.router.proxy import Router

METHOD = f"/{schema.SERVICE}/ModelInfer"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[WorkerProcess]]]:
    tmp = tmp_path_factory.mktemp("router-grpc")
    with slowable.workers(tmp, 2) as workers:
        yield tmp, workers


@contextlib.asynccontextmanager
async def _routed(urls: list[str], **changes: Any) -> AsyncIterator[Router]:
    """A router with gRPC on a free port. Another process (the other lane of `make test`) may
    take that port between its choice and the bind: the router then serves HTTP alone, and is
    started again on another port."""
    for attempt in range(3):
        async with running_router(urls, grpc_port=free_port(), **changes) as router:
            if router.grpc_port is not None or attempt == 2:
                yield router
                return


class Caller:
    """ModelInfer over a raw channel, to see the reply's trailing metadata."""

    def __init__(self, router: Router) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}")
        self.infer = self.channel.unary_unary(
            METHOD,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=schema.ModelInferResponse.FromString,
        )
        self.raw = self.channel.unary_unary(METHOD, response_deserializer=lambda data: data)

    async def call(
        self, message: Any, deadline_s: float | None = 30.0
    ) -> tuple[Any, dict[str, str]]:
        call = self.infer(message, timeout=deadline_s)
        reply = await call
        return reply, dict(await call.trailing_metadata())

    async def error(self, message: Any) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await self.infer(message, timeout=30.0)
        return caught.value


@pytest.fixture
async def caller_factory() -> AsyncIterator[Any]:
    made: list[Caller] = []

    def make(router: Router) -> Caller:
        made.append(Caller(router))
        return made[-1]

    yield make
    for caller in made:
        await caller.channel.close()


def request(x: float, model: str = "m", **changes: Any) -> Any:
    """y = 2x's request, x raw."""
    message = schema.ModelInferRequest(model_name=model, **changes)
    message.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    message.raw_input_contents.append(np.array([[x]], dtype=np.float32).tobytes())
    return message


def y_of(reply: Any) -> float:
    (output,) = reply.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("y", "FP32", [1, 1])
    return float(np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)[0])


async def test_grpc_calls_reach_the_workers_through_the_router(
    pair: Any, caller_factory: Any
) -> None:
    _, workers = pair
    urls = [w.url for w in workers]
    async with _routed(urls, balance="round-robin", hedge=False) as router:
        caller = caller_factory(router)
        replicas = set()
        for i in range(4):
            reply, metadata = await caller.call(request(float(i), id=f"r{i}"))
            assert y_of(reply) == 2.0 * i and reply.id == f"r{i}" and reply.model_name == "m"
            replicas.add(metadata["x-tailserve-replica"])
        assert replicas == set(urls)
        # Typed contents (no raw buffers) too: the router turns them into raw data.
        typed = schema.ModelInferRequest(model_name="m")
        tensor = typed.inputs.add(name="x", datatype="FP32", shape=[1, 1])
        tensor.contents.fp32_contents.append(-1.5)
        reply, _ = await caller.call(typed)
        assert y_of(reply) == -3.0
        # tritonclient.grpc, unchanged (blocking: in a thread, the router runs in this loop).
        address = f"127.0.0.1:{router.grpc_port}"

        def with_tritonclient() -> dict[str, Any]:
            with triton_grpc.InferenceServerClient(address) as client:
                x = triton_grpc.InferInput("x", [1, 1], "FP32")
                x.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
                return {
                    "live": client.is_server_live(),
                    "ready": client.is_server_ready(),
                    "model": client.is_model_ready("m"),
                    "unknown": client.is_model_ready("nope"),
                    "server": client.get_server_metadata().name,
                    "inputs": [i.name for i in client.get_model_metadata("m").inputs],
                    "y": client.infer("m", [x]).as_numpy("y").tolist(),
                }

        seen = await asyncio.to_thread(with_tritonclient)
        assert seen == {
            "live": True,
            "ready": True,
            "model": True,
            "unknown": False,
            "server": "tailserve",
            "inputs": ["x"],
            "y": [[8.0]],
        }
        metrics = router.metrics.render().decode()
        assert 'tailserve_router_requests_total{model="m",status="200"} 6.0' in metrics


async def test_grpc_errors_name_the_problem_and_the_router_keeps_serving(
    pair: Any, caller_factory: Any
) -> None:
    _, workers = pair
    async with _routed([w.url for w in workers], hedge=False) as router:
        caller = caller_factory(router)
        unknown = await caller.error(request(1.0, model="nope"))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details()
        wrong = request(1.0)
        wrong.inputs[0].datatype = "INT64"  # 4 bytes of data for an INT64 [1, 1]
        bad = await caller.error(wrong)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "x" in bad.details()
        extra = request(1.0)
        extra.raw_input_contents.append(b"\0\0\0\0")
        counted = await caller.error(extra)
        assert counted.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2 buffers for 1 inputs" in counted.details()
        with pytest.raises(grpc.aio.AioRpcError) as garbage:
            await caller.raw(b"\xff\xff\xff", timeout=30.0)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid ModelInferRequest" in (garbage.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as metadata:
            channel = caller.channel
            ask = channel.unary_unary(
                f"/{schema.SERVICE}/ModelMetadata",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=schema.ModelMetadataResponse.FromString,
            )
            await ask(schema.ModelMetadataRequest(name="nope"), timeout=30.0)
        assert metadata.value.code() == grpc.StatusCode.NOT_FOUND
        reply, _ = await caller.call(request(7.0))
        assert y_of(reply) == 14.0


async def test_a_grpc_call_is_hedged_to_another_replica(
    tmp_path: Path, caller_factory: Any
) -> None:
    with slowable.workers(tmp_path, 2) as workers:
        urls = [w.url for w in workers]
        async with _routed(
            urls, balance="round-robin", hedge_min_samples=5, hedge_ratio=1.0
        ) as router:
            caller = caller_factory(router)
            for i in range(20):  # the model's p95, learnt (milliseconds)
                await caller.call(request(100.0 + i))
            slowable.slow(tmp_path, 0, 1.5)
            replies = await asyncio.gather(*(caller.call(request(float(x))) for x in range(1, 7)))
            slowable.slow(tmp_path, 0, 0)
            assert [y_of(reply) for reply, _ in replies] == [2.0 * x for x in range(1, 7)]
            # None waited for the slow worker: those sent to it were answered by their hedges.
            assert {m["x-tailserve-replica"] for _, m in replies} == {urls[1]}
            assert any(m.get("x-tailserve-hedged") == "1" for _, m in replies)


async def test_a_saturated_fleet_sheds_grpc_calls_at_once(
    tmp_path: Path, caller_factory: Any
) -> None:
    with slowable.workers(tmp_path, 1) as workers:
        slowable.slow(tmp_path, 0, 3.0)
        async with _routed([workers[0].url], max_in_flight=1, hedge=False) as router:
            caller = caller_factory(router)
            held = asyncio.ensure_future(caller.call(request(1.0)))

            async def one_in_flight() -> bool:
                return router.dispatcher.backends[0].in_flight == 1

            await async_wait_for(one_in_flight, what="the first call to take the one slot")
            shed = await caller.error(request(2.0))
            assert not held.done(), "the shed call waited for the 3 s reply"
            assert shed.code() == grpc.StatusCode.UNAVAILABLE, shed.details()
            assert "retry-after" in dict(shed.trailing_metadata() or ())
            slowable.slow(tmp_path, 0, 0)
            reply, _ = await held
            assert y_of(reply) == 2.0


async def test_the_calls_deadline_reaches_the_worker(caller_factory: Any) -> None:
    stub = StubApp()
    with run_stub(stub) as s:
        async with _routed([s.url], hedge=False) as router:
            caller = caller_factory(router)
            reply, metadata = await caller.call(request(1.0), deadline_s=0.8)
            await caller.call(request(1.0), deadline_s=None)
    assert metadata["x-tailserve-replica"] == s.url
    # (The stub answers in JSON: the router sends its outputs on raw all the same.)
    assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [0.5]
    infers = [a for a in stub.arrivals if a.path.endswith("/infer")]
    left = float(infers[0].headers["x-deadline-ms"])
    # (The deadline crosses as a grpc-timeout header, which the server's core turns back into
    # a deadline of its own: a run came out 0.46 ms over the 800 ms sent.)
    assert 600 < left <= 801
    assert "x-deadline-ms" not in infers[1].headers
    assert infers[0].headers["inference-header-content-length"].isdigit()


async def test_a_drain_lets_grpc_calls_in_flight_finish_and_refuses_new_ones(
    tmp_path: Path, caller_factory: Any
) -> None:
    with slowable.workers(tmp_path, 1) as workers:
        async with _routed([workers[0].url], hedge=False) as router:
            caller = caller_factory(router)
            await caller.call(request(1.0))
            slowable.slow(tmp_path, 0, 1.0)
            in_flight = asyncio.ensure_future(caller.call(request(3.0)))

            async def one_in_flight() -> bool:
                return router.dispatcher.backends[0].in_flight == 1

            await async_wait_for(one_in_flight, what="the call to reach the worker")
            drain = asyncio.ensure_future(router.drain(timeout_s=10))

            async def draining() -> bool:
                return router.draining

            await async_wait_for(draining, what="the drain to begin")
            late = Caller(router)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await late.infer(request(4.0), timeout=5.0)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                await late.channel.close()
            reply, _ = await in_flight
            assert y_of(reply) == 6.0
            await drain
        slowable.slow(tmp_path, 0, 0)
