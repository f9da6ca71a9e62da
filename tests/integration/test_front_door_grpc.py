"""gRPC through the front door as gRPC (`frontdoor.render_grpc`): HAProxy alone, with the
rendered config and its Lua ejection script, in front of two real workers that serve different
models: each call goes to a worker where its model is ready, a busy model's calls are refused at
the door as gRPC statuses, streams take no admission slot, and a worker failing calls is
ejected."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from support.fleet import held
from support.models import doubler_config, write_model
from support.servers import RunningWorker, async_wait_for, free_port, run_worker
from tailserve.fleet.load import parse_stat
from tailserve.fleet.processes import free_ports
from tailserve.frontdoor.haproxy import HAProxy, grpc_ejection_script
from tailserve.frontdoor.render import FrontDoorPolicy, Listen, Member, render
from tailserve.settings import Settings

BROKEN = """
class Model:
    def __init__(self, version_dir, config):
        pass

    def predict(self, inputs):
        raise RuntimeError("this copy of the model is broken")
"""
SLOW = doubler_config(
    parameters={"delay": 1.0},
    max_batch_size=1,
    slo={"p99_ms": 10_000},
    warmup={"batch_sizes": [1]},
)
MODELS = {"alpha": 1000.0, "beta": 1000.0, "both": 1000.0, "flaky": 1000.0, "slow": 10_000.0}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Member]]:
    """worker-a: alpha, both, flaky, slow; worker-b: beta, both, and a flaky that fails."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    for name in ("alpha", "both", "flaky"):
        write_model(a, name, doubler_config())
    write_model(a, "slow", SLOW)
    for name in ("beta", "both"):
        write_model(b, name, doubler_config())
    write_model(b, "flaky", doubler_config(warmup={"batch_sizes": []}), code=BROKEN)
    with contextlib.ExitStack() as stack:
        members = []
        for name, repository in (("worker-a", a), ("worker-b", b)):
            grpc_port = free_port()
            settings = Settings(repository=str(repository), grpc_port=grpc_port)
            running: RunningWorker = stack.enter_context(run_worker(settings))
            members.append(Member(name, "127.0.0.1", running.port, grpc_port))
        yield members


@contextlib.asynccontextmanager
async def front_door(
    tmp_path: Path, members: list[Member], policy: FrontDoorPolicy
) -> AsyncIterator[tuple[HAProxy, Any]]:
    """HAProxy on the rendered config, and a stub of the inference service through it."""
    http_port, grpc_port = free_ports(2)
    listen = Listen(
        host="127.0.0.1",
        port=http_port,
        grpc_port=grpc_port,
        grpc_ejection=grpc_ejection_script(),
    )
    door = HAProxy(tmp_path)
    # (Within the descriptors a test process may open: two a connection.)
    policy = dataclasses.replace(policy, max_connections=500)
    await door.start(render(listen, members, MODELS, policy))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield door, service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await door.drain(1.0)


async def states(door: HAProxy, backend: str) -> dict[str, str]:
    try:
        stat = parse_stat(await door.command("@1 show stat"))
    except OSError:
        return {}
    # (The state's first word: "UP 1/2" is up, its checks not yet all passed.)
    return {
        server: row["status"].split()[0]
        for (proxy, server), row in stat.items()
        if proxy == backend
    }


def infer_request(model: str, value: float = 1.5) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend([1, 1])
    request.raw_input_contents.append(np.array([value], dtype=np.float32).tobytes())
    return request


def answer(response: Any) -> float:
    return float(np.frombuffer(response.raw_output_contents[0], dtype=np.float32)[0])


async def test_each_call_goes_to_a_worker_where_its_model_is_ready(
    tmp_path: Path, workers: list[Member]
) -> None:
    # p2c over both workers would send about half of alpha's calls to worker-b, which has no
    # alpha (NOT_FOUND): the door reads the model's name from each call and sends it to the
    # model's own backend.
    # (Checks every 200 ms: the door learns within a second where each model is not ready.)
    policy = FrontDoorPolicy(check_interval_ms=200)
    async with front_door(tmp_path, workers, policy) as (door, stub):

        async def settled() -> bool:
            alpha, beta = await states(door, "g.alpha"), await states(door, "g.beta")
            return (alpha.get("worker-b"), beta.get("worker-a")) == ("DOWN", "DOWN")

        await async_wait_for(settled, what="each model's backend to know where it is ready")
        for model in ("alpha", "beta") * 20:
            response = await stub.ModelInfer(infer_request(model, 2.0), timeout=5)
            assert answer(response) == 5.0  # 2x + 1
        for model in ("alpha", "beta"):
            ready = await stub.ModelReady(service_pb2.ModelReadyRequest(name=model), timeout=5)
            assert ready.ready
            metadata = await stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=model), timeout=5
            )
            assert metadata.name == model
        # A model the door does not know goes to any worker, which says what is wrong.
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.ModelInfer(infer_request("gamma"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "gamma" in str(unknown.value.details())


async def test_a_busy_models_calls_are_refused_at_once_and_streams_take_no_slot(
    tmp_path: Path, workers: list[Member]
) -> None:
    # One call in flight a worker and one queued: the rest are refused at the door as gRPC's
    # UNAVAILABLE, saying why, without waiting in the queue (its timeout: half the SLO, 5 s).
    policy = FrontDoorPolicy(max_conn=1, max_queue=1, check_interval_ms=200)
    async with front_door(tmp_path, workers, policy) as (door, stub):

        async def settled() -> bool:
            return (await states(door, "g.slow")).get("worker-b") == "DOWN"

        await async_wait_for(settled, what="slow's backend to hold worker-a alone")

        async def one() -> tuple[grpc.StatusCode, float, dict[str, str], str]:
            begun = time.perf_counter()
            try:
                await stub.ModelInfer(infer_request("slow"), timeout=10)
            except grpc.aio.AioRpcError as error:
                trailing = dict(error.trailing_metadata() or ())
                details = str(error.details())
                return error.code(), time.perf_counter() - begun, trailing, details
            return grpc.StatusCode.OK, time.perf_counter() - begun, {}, ""

        first = [asyncio.create_task(one()) for _ in range(2)]

        async def in_door() -> bool:
            return await held(door, "g.slow", "worker-a") >= 2

        await async_wait_for(in_door, what="one call in flight and one queued")
        rest = await asyncio.gather(*(one() for _ in range(4)))

        # Meanwhile, streams: each holds its connection for its life, and takes no slot of a
        # model's backend (with one slot a worker, four streams would wait on each other).
        async def stream(index: int) -> list[float]:
            def requests() -> Iterator[Any]:
                for n in range(5):
                    message = infer_request("both", float(n))
                    message.id = f"{index}-{n}"
                    yield message

            call = stub.ModelStreamInfer(requests(), timeout=10)
            values = []
            async for reply in call:
                assert not reply.error_message, reply.error_message
                values.append(answer(reply.infer_response))
            return sorted(values)

        streamed = await asyncio.gather(*(stream(i) for i in range(4)))
        results = [*await asyncio.gather(*first), *rest]
    codes = [code for code, *_ in results]
    assert codes.count(grpc.StatusCode.OK) == 2 and codes.count(grpc.StatusCode.UNAVAILABLE) == 4
    for code, took, trailing, details in results:
        if code is grpc.StatusCode.UNAVAILABLE:
            assert took < 2.5, f"a refusal took {took:.3f} s: it waited in the queue"
            assert trailing["x-refusal-reason"] == "frontdoor_full"
            assert "busy" in details
    assert streamed == [[1.0, 3.0, 5.0, 7.0, 9.0]] * 4


async def test_a_worker_failing_calls_is_ejected_and_a_bad_request_ejects_none(
    tmp_path: Path, workers: list[Member]
) -> None:
    # worker-b's flaky fails every call (INTERNAL); worker-a's serves. Round robin alternates
    # between them until the Lua action has counted `error_limit` failures in a row from
    # worker-b and marked it down; no check comes while the test runs to bring it back.
    policy = FrontDoorPolicy(
        balance="round-robin",
        error_limit=3,
        check_interval_ms=60_000,
        down_check_interval_ms=60_000,
    )
    async with front_door(tmp_path, workers, policy) as (door, stub):
        # Calls a worker refuses as the client's fault (INVALID_ARGUMENT) count as no failure:
        # each worker refuses `error_limit` of them and stays in.
        for _ in range(2 * policy.error_limit):
            bad = infer_request("both")
            bad.inputs[0].name = "nope"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ModelInfer(bad, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await states(door, "g.both") == {"worker-a": "UP", "worker-b": "UP", "BACKEND": "UP"}
        codes = []
        for _ in range(30):
            try:
                await stub.ModelInfer(infer_request("flaky"), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
        flaky = await states(door, "g.flaky")
    assert codes.count(grpc.StatusCode.INTERNAL) == 3, codes
    assert codes[-20:] == [grpc.StatusCode.OK] * 20
    assert flaky == {"worker-a": "UP", "worker-b": "DOWN", "BACKEND": "UP"}
