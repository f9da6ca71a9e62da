"""The client library through a front door, its one backend: an inference that found the door
closed (restarting), or full for a moment (503 + Retry-After), is sent again after a pause and
answered; a refusal that a later try would not change is not. Found by the chaos suite."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import orjson

from support.servers import free_port
from tailserve.client import Client, InferenceError

REPLY = orjson.dumps(
    {
        "model_name": "m",
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}],
    }
)


class Door:
    """A front door on loopback: health checks answered 200, inferences with ``statuses`` in
    turn (then 200), each counted."""

    def __init__(self, port: int, statuses: list[tuple[int, bool]]) -> None:
        self.port = port
        self.statuses = statuses  # (status, with Retry-After)
        self.inferences = 0
        self.writers: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                status, retry_after, body = 200, False, b'{"ready": true}'
                if b"/infer " in head.split(b"\r\n", 1)[0]:
                    self.inferences += 1
                    status, retry_after = self.statuses.pop(0) if self.statuses else (200, False)
                    body = REPLY if status == 200 else b'{"error": "busy"}'
                extra = b"retry-after: 1\r\n" if retry_after else b""
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n%s" % (status, extra)
                    + b"content-length: %d\r\n\r\n" % len(body)
                    + body
                )
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def door_open(door: Door) -> AsyncIterator[asyncio.Server]:
    server = await asyncio.start_server(door.handle, "127.0.0.1", door.port, reuse_address=True)
    try:
        yield server
    finally:
        server.close()
        for writer in door.writers:
            writer.close()
        await server.wait_closed()


INPUTS = {"x": np.array([[0.5]], dtype=np.float32)}


async def test_an_inference_waits_out_a_front_door_restart() -> None:
    door = Door(free_port(), [])
    async with door_open(door), Client([f"http://127.0.0.1:{door.port}"]) as client:
        assert (await client.infer("m", INPUTS)).outputs["y"].item() == 0.5
    # The door is down (connections refused) and comes back 300 ms later.
    async with Client([f"http://127.0.0.1:{door.port}"]) as client:

        async def reopen() -> None:
            await asyncio.sleep(0.3)
            async with door_open(door):
                await asyncio.sleep(5.0)

        back = asyncio.create_task(reopen())
        try:
            result = await asyncio.wait_for(client.infer("m", INPUTS, deadline_ms=3000), 5.0)
        finally:
            back.cancel()
            await asyncio.gather(back, return_exceptions=True)
    assert result.outputs["y"].item() == 0.5
    assert door.inferences == 2


async def test_a_full_front_door_is_tried_again_and_a_plain_refusal_is_not() -> None:
    door = Door(free_port(), [(503, True), (503, True)])
    async with door_open(door), Client([f"http://127.0.0.1:{door.port}"]) as client:
        result = await client.infer("m", INPUTS, deadline_ms=3000)
        assert result.outputs["y"].item() == 0.5
        assert door.inferences == 3
        # A 503 without Retry-After (a worker's own), or a 400, would be the same again.
        door.statuses = [(503, False), (400, False)]
        for status in (503, 400):
            try:
                await client.infer("m", INPUTS, deadline_ms=3000)
            except InferenceError as exc:
                assert exc.status == status
            else:
                raise AssertionError(f"a {status} was retried into a success")
        assert door.inferences == 5
