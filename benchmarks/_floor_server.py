"""The floor under a Python worker's CPU a request: the least an asyncio server does to answer
churn's OIP JSON requests in batches, with the libraries the worker uses (uvloop, httptools,
orjson, numpy, ONNX Runtime). Not tailserve: no options, admission, cache, metrics, checks
beyond the inputs' names, or error handling; a measuring instrument for `cpu_floor.py`.

    python benchmarks/_floor_server.py MODEL.onnx PORT callbacks|tasks

``callbacks``: each request is queued from the parser's callback and answered from the batch's
(no task, no future); ``tasks``: each request is a task awaiting a future, as a coroutine
server's are. The requests read in one turn of the event loop run as one batch.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httptools
import numpy as np
import onnxruntime as ort
import orjson
import uvloop

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"


class Floor:
    def __init__(self, model: str, mode: str) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: _dtype(i.type) for i in self.session.get_inputs()}
        self.output = self.session.get_outputs()[-1].name
        self.tasks = mode == "tasks"
        self.pending: list[tuple[dict[str, Any], Any]] = []

    def add(self, values: dict[str, Any], target: Any) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.run)
        self.pending.append((values, target))

    def run(self) -> None:
        batch, self.pending = self.pending, []
        feeds = {
            name: np.array([values[name] for values, _ in batch], dtype=dtype).reshape(-1, 1)
            for name, dtype in self.inputs.items()
        }
        (scores,) = self.session.run([self.output], feeds)
        for (_, target), score in zip(
            batch, np.asarray(scores).reshape(len(batch), -1), strict=True
        ):
            value = float(score[-1])
            if self.tasks:
                target.set_result(value)
            else:
                reply(target, value)

    async def answer(self, values: dict[str, Any], transport: Any) -> None:
        future = asyncio.get_running_loop().create_future()
        self.add(values, future)
        reply(transport, await future)


def reply(transport: Any, value: float) -> None:
    output = {"name": "churn_probability", "datatype": "FP32", "shape": [1, 1], "data": [value]}
    body = orjson.dumps({"model_name": "churn", "outputs": [output]})
    transport.write(_HEAD % len(body) + body)


def _dtype(onnx_type: str) -> Any:
    if onnx_type == "tensor(string)":
        return object
    return np.int64 if "int64" in onnx_type else np.float32


class Connection(asyncio.Protocol):
    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport  # (uvloop's transport is no asyncio.Transport)
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.body:  # (a GET: the readiness check)
            self.transport.write(_HEAD % 2 + b"{}")
            return
        document = orjson.loads(b"".join(self.body))
        self.body = []
        values = {tensor["name"]: tensor["data"][0] for tensor in document["inputs"]}
        if self.floor.tasks:
            asyncio.get_running_loop().create_task(self.floor.answer(values, self.transport))
        else:
            self.floor.add(values, self.transport)


async def main(model: str, port: int, mode: str) -> None:
    floor = Floor(model, mode)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(floor), "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
